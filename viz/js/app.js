// ccalloc memory viewer: App (the tabs and their views) and the start-up. Embedded into one
// HTML file by `ccalloc viz` with its data (see viz/page.hpp for the payload and
// viz/model.hpp for what the columns mean). Its sources are the files of viz/js/, joined in
// the order viz/CMakeLists.txt lists them into one strict-mode function scope (so they
// share their top-level names, and no other script sees them); this one comes last.
// No libraries and no requests: canvas 2D drawing into pixel buffers, typed arrays
// throughout, so a trace of a million entries loads in about a second and pans at frame
// rate.
//
// Views:
//   Timeline        live allocations stacked in allocation order (PyTorch's "Active Memory
//                   Timeline"), reserved memory above them. Each pixel column shows the
//                   state at the event where live memory peaks within that column, so peaks
//                   survive any zoom; the K largest allocations get their own band and the
//                   rest share one grey band. A linked list of the live K-set is advanced
//                   event by event from checkpoints, so a frame costs O(events in view +
//                   columns x live K-allocations).
//   Allocator state segments split into blocks after a chosen event, rebuilt from the
//                   allocation and segment intervals in O(allocations); the event list is
//                   virtual and searchable by address.
//   OOM             for each oom entry: the request against the largest free block, where
//                   free bytes are stranded, the reason (the logic of ccalloc's OOM message,
//                   src/native/oom_ladder.cpp) and the replays that test alternative configs.
//   Summary         memory_summary(), peaks, settings.
//   Pieces          stitching policy only: the physical pieces behind each address range's
//                   pages at the snapshot, dead and unmapped pages, spare pieces, and each
//                   range's fragmentation (pieces_view.js).

// ---------------------------------------------------------------------------------------
// App

class App {
  constructor(data) {
    this.data = data;
    const m = data.meta;
    $('file-title').textContent = m.title;
    $('file-title').title = m.title + ' \u2014 ' + m.source;
    this.timeline = new Timeline(this);
    this.state = new StateView(this);
    this.oom = new OomView(this);
    this.pieces = m.physical ? new PiecesView(this) : null;
    $('tabbtn-pieces').hidden = !this.pieces;
    this.tab = 'timeline';
    this.rendered = {};
    for (const b of document.querySelectorAll('.tabs button')) b.addEventListener('click', () => this.showTab(b.dataset.tab));
    $('help-btn').addEventListener('click', () => $('help').showModal());
    document.addEventListener('keydown', (ev) => this.onKey(ev));
  }
  showTab(name) {
    this.tab = name;
    for (const b of document.querySelectorAll('.tabs button')) b.setAttribute('aria-selected', b.dataset.tab === name ? 'true' : 'false');
    for (const s of document.querySelectorAll('.tab')) s.classList.toggle('active', s.id === 'tab-' + name);
    tooltip.hide();
    if (name === 'timeline') { this.timeline.resize(); this.timeline.invalidate(); }
    if (name === 'state') { if (!this.state.state) this.state.select(this.state.sel); else this.state.refresh(); }
    if (name === 'oom' && !this.rendered.oom) { this.oom.show(0); this.rendered.oom = true; }
    if (name === 'summary' && !this.rendered.summary) { renderSummary(this); this.rendered.summary = true; }
    if (name === 'pieces' && !this.rendered.pieces) { this.pieces.render(); this.rendered.pieces = true; }
  }
  openState(e, alloc) {
    this.showTab('state');
    this.state.select(e, { alloc: alloc === undefined ? -1 : alloc });
    this.state.list.focus({ preventScroll: true });
  }
  openTimelineAlloc(a) {
    this.showTab('timeline');
    const d = this.data;
    this.timeline.focusEvents(Math.max(0, d.alStart[a]), Math.min(d.N - 1, d.alEnd[a]));
    this.timeline.pin(a);
  }
  openOom(i) { this.showTab('oom'); this.oom.show(i); this.rendered.oom = true; }
  onKey(ev) {
    const t = ev.target;
    const typing = t && (t.tagName === 'INPUT' || t.tagName === 'SELECT' || t.tagName === 'TEXTAREA');
    if (ev.key === 'Escape') { this.timeline.pin(-1); tooltip.hide(); return; }
    if (typing || ev.ctrlKey || ev.metaKey || ev.altKey) return;
    const tabs = { 1: 'timeline', 2: 'state', 3: 'oom', 4: 'summary', 5: this.pieces ? 'pieces' : null };
    if (tabs[ev.key]) { this.showTab(tabs[ev.key]); ev.preventDefault(); return; }
    if (ev.key === '?') { $('help').showModal(); return; }
    if (ev.key === '/') { this.showTab('state'); $('ev-search').focus(); ev.preventDefault(); return; }
    if (this.tab === 'timeline' && t === document.body && ['ArrowLeft', 'ArrowRight', '+', '-', '=', '0'].includes(ev.key)) {
      this.timeline.chart.focus(); this.timeline.chart.dispatchEvent(new KeyboardEvent('keydown', { key: ev.key }));
    }
    if (this.tab === 'state' && t === document.body && ['ArrowUp', 'ArrowDown', 'PageUp', 'PageDown', 'Home', 'End'].includes(ev.key)) {
      this.state.list.focus(); this.state.onKey(ev);
    }
  }
}

async function main() {
  try {
    const { meta, cols } = await loadPayload();
    const data = new Data(meta, cols);
    viz.loadMs = performance.now();
    const app = new App(data);
    viz.app = app;
    viz.data = { events: data.N, allocations: data.A, spans: data.S, detail: app.timeline.layout.K, maxDepth: app.timeline.layout.maxDepth };
    // Scripting and test hooks.
    viz.showTab = (name) => app.showTab(name);
    viz.selectEvent = (e) => app.openState(e);
    viz.stateSummary = () => (app.state.state ? Object.assign({ event: app.state.sel }, app.state.state.totals) : null);
    viz.bandPoint = (opts) => app.timeline.bandPoint(opts);
    viz.setView = (x0, x1) => { app.timeline.view = [x0, x1]; app.timeline.clampView(); app.timeline.invalidate(); };
    viz.view = () => app.timeline.view.slice();
    // The pieces tab: page i of range r ({address, state, handle, piece, free, lentTo}).
    viz.piecePage = (r, i) => (app.pieces ? app.pieces.pageInfo(data.meta.physical.ranges[r], i) : null);
    app.timeline.resize();
    app.timeline.invalidate();
    if (data.N === 0) { viz.ready = true; viz.firstFrameMs = performance.now(); $('loading').hidden = true; }
  } catch (err) {
    viz.error = String(err && err.stack ? err.stack : err);
    const el = $('loading');
    el.classList.add('error');
    el.textContent = 'The viewer could not load this file: ' + viz.error;
    throw err;
  }
}
main();
