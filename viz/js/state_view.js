// StateView: the allocator's segments and blocks after a chosen event (stateAt), with
// the virtual, searchable event list.

// ---------------------------------------------------------------------------------------
// Allocator state at an event

// Segments and their blocks after event e (-1: before the first event). Spans of one
// stream that touch merge into one segment, as PyTorch reports runs of mapped pages.
// Free blocks are the gaps between live blocks; a gap no larger than a block's slack
// belongs to that block (the split rule left it there).
function stateAt(d, e) {
  const spans = [];
  for (let s = 0; s < d.S; s++) if (d.spStart[s] <= e && e < d.spEnd[s]) spans.push(s);
  spans.sort((x, y) => d.spAddr[x] - d.spAddr[y]);
  const segs = [];
  for (const s of spans) {
    const exp = (d.spFlags[s] & SP_EXPANDABLE) !== 0;
    const last = segs[segs.length - 1];
    if (last && exp && last.expandable && last.stream === d.spStream[s] && last.addr + last.size === d.spAddr[s]) {
      last.size += d.spSize[s];
      continue;
    }
    segs.push({
      addr: d.spAddr[s], size: d.spSize[s], stream: d.spStream[s], expandable: exp,
      small: (d.spFlags[s] & SP_SMALL) !== 0, typeKnown: (d.spFlags[s] & SP_TYPE_KNOWN) !== 0,
      stack: d.spStack[s], span: s, blocks: [],
      allocated: 0, requested: 0, pending: 0, free: 0, largest: 0, largestBlock: null, nalloc: 0,
    });
  }
  const live = [];
  for (let a = 0; a < d.A; a++) {
    if (d.alStart[a] > e) break;  // allocations are in start order
    if (e < d.alEnd[a]) live.push(a);
  }
  live.sort((x, y) => d.alAddr[x] - d.alAddr[y]);
  let i = 0, orphans = 0;
  const addFree = (g, lo, hi) => {
    const b = { a: -1, addr: lo, size: hi - lo, req: 0, pending: false };
    g.blocks.push(b);
    g.free += b.size;
    if (b.size > g.largest) { g.largest = b.size; g.largestBlock = b; }
  };
  for (const g of segs) {
    const end = g.addr + g.size;
    while (i < live.length && d.alAddr[live[i]] < g.addr) { orphans++; i++; }
    let cursor = g.addr;
    while (i < live.length && d.alAddr[live[i]] < end) {
      const a = live[i++];
      const addr = d.alAddr[a];
      if (addr < cursor) { orphans++; continue; }  // overlaps the block before: inconsistent
      if (addr > cursor) addFree(g, cursor, addr);
      const nextStart = i < live.length && d.alAddr[live[i]] < end ? d.alAddr[live[i]] : end;
      let blockEnd = addr + Math.max(d.alBlock[a], d.alSize[a]);
      if (nextStart > blockEnd && nextStart - blockEnd <= d.alSlack[a]) blockEnd = nextStart;
      if (blockEnd > nextStart) blockEnd = nextStart;
      const pending = d.alFreeReq[a] <= e;
      const b = { a, addr, size: blockEnd - addr, req: Math.min(d.alSize[a], blockEnd - addr), pending };
      g.blocks.push(b);
      if (pending) g.pending += b.size; else { g.allocated += b.size; g.requested += b.req; }
      g.nalloc++;
      cursor = blockEnd;
    }
    if (cursor < end) addFree(g, cursor, end);
    g.frag = g.free > 0 ? 1 - g.largest / g.free : 0;
  }
  orphans += live.length - i;
  const t = { segments: segs.length, reserved: 0, allocated: 0, requested: 0, pending: 0, free: 0, largest: 0, live: live.length };
  for (const g of segs) {
    t.reserved += g.size; t.allocated += g.allocated; t.requested += g.requested; t.pending += g.pending;
    t.free += g.free; t.largest = Math.max(t.largest, g.largest);
  }
  t.frag = t.free > 0 ? 1 - t.largest / t.free : 0;
  return { event: e, segments: segs, totals: t, orphans };
}

const ROW_H = 20;        // event list row (CSS px)
const SEG_ROW_H = 40;    // segment row
const MAX_SCROLL_PX = 4e6;  // browsers cap element heights; longer lists scroll scaled

class StateView {
  constructor(app) {
    this.app = app;
    const d = (this.d = app.data);
    this.sel = d.N > 0 ? d.N - 1 : -1;
    this.state = null;
    this.sort = 'address';
    this.trueScale = false;
    this.matches = null;
    this.matchPos = -1;
    this.pinnedBlock = null;
    this.highlightAlloc = -1;
    this.list = $('ev-list');
    this.rowsEl = $('ev-rows');
    this.spacer = $('ev-spacer');
    this.rowPool = [];
    this.scroll = $('st-scroll');
    this.canvas = $('st-canvas');
    this.ctx = this.canvas.getContext('2d');
    this.list.addEventListener('scroll', () => this.renderRows());
    this.list.addEventListener('keydown', (ev) => this.onKey(ev));
    this.list.addEventListener('click', (ev) => {
      const row = ev.target.closest('.ev-row');
      if (row) { this.select(+row.dataset.idx, { scroll: false }); this.list.focus({ preventScroll: true }); }
    });
    const search = $('ev-search');
    let timer = 0;
    search.addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(() => this.runSearch(search.value), 120); });
    search.addEventListener('keydown', (ev) => {
      if (ev.key === 'Enter') {
        ev.preventDefault();
        clearTimeout(timer);
        if (this.query !== search.value) this.runSearch(search.value);
        this.stepMatch(ev.shiftKey ? -1 : 1);
      } else if (ev.key === 'ArrowDown' || ev.key === 'ArrowUp') {
        this.list.focus(); this.onKey(ev);
      }
    });
    $('ev-next').addEventListener('click', () => this.stepMatch(1));
    $('ev-prev').addEventListener('click', () => this.stepMatch(-1));
    $('st-sort').addEventListener('change', (ev) => { this.sort = ev.target.value; this.order(); this.drawSegments(); });
    $('st-scale').addEventListener('change', (ev) => { this.trueScale = ev.target.checked; this.drawSegments(); });
    this.scroll.addEventListener('scroll', () => this.drawSegments());
    this.canvas.addEventListener('mousemove', (ev) => this.onSegMove(ev));
    this.canvas.addEventListener('mouseleave', () => { tooltip.hide(); if (this.hoverBlock) { this.hoverBlock = null; this.drawSegments(); } });
    this.canvas.addEventListener('click', (ev) => {
      const h = this.segHit(ev);
      this.pinnedBlock = h && h.block ? h : null;
      this.highlightAlloc = h && h.block && h.block.a >= 0 ? h.block.a : -1;
      this.showDetails();
      this.drawSegments();
    });
    new ResizeObserver(() => { if (this.visible()) this.refresh(); }).observe(this.scroll);
    new ResizeObserver(() => { if (this.visible()) this.renderRows(); }).observe(this.list);
  }
  visible() { return this.list.offsetParent !== null; }
  refresh() { this.renderRows(); this.drawSegments(); }

  select(e, { scroll = true, alloc = -1 } = {}) {
    const d = this.d;
    this.sel = d.N > 0 ? clamp(e, 0, d.N - 1) : -1;
    this.state = stateAt(d, this.sel);
    if (alloc >= 0) this.highlightAlloc = alloc;
    this.pinnedBlock = null;
    this.order();
    this.renderHeader();
    if (scroll) this.scrollToSel();
    this.renderRows();
    this.drawSegments();
    this.showDetails();
    if (alloc >= 0) this.scrollToAlloc(alloc);
  }
  order() {
    const segs = this.state ? this.state.segments : [];
    const idx = segs.map((_, i) => i);
    const key = {
      address: (g) => g.addr, size: (g) => -g.size, free: (g) => -g.free, frag: (g) => -(g.frag * 1e18 + g.free),
    }[this.sort];
    idx.sort((x, y) => key(segs[x]) - key(segs[y]) || segs[x].addr - segs[y].addr);
    this.orderIdx = idx;
  }
  renderHeader() {
    const d = this.d, st = this.state, t = st.totals, e = this.sel;
    const h = $('st-header');
    h.dataset.event = e;
    h.dataset.segments = t.segments;
    const time = d.hasTime && e >= 0 ? ' <span class="muted">(+' + fmtDuration(d.time(e)) + ')</span>' : '';
    const chip = (label, value, title) => '<span class="chip"' + (title ? ' title="' + esc(title) + '"' : '') + '><span class="muted">' + label + '</span><b>' + value + '</b></span>';
    h.innerHTML = '<div class="event-line">' + (e >= 0 ? 'After event <b>#' + fmtInt(e) + '</b> of ' + fmtInt(d.N) + ': ' + esc(d.eventLine(e)) + time : 'No trace entries: the snapshot as taken') + '</div>' +
      '<div class="chips">' +
      chip('Segments', '<span id="st-segment-count">' + fmtInt(t.segments) + '</span>') +
      chip('Reserved', fmtSize(t.reserved), fmtBytes(t.reserved)) +
      chip('Allocated', fmtSize(t.allocated), 'blocks handed out, rounded sizes: ' + fmtBytes(t.allocated)) +
      chip('Requested', fmtSize(t.requested), fmtBytes(t.requested)) +
      (t.pending ? chip('Pending free', fmtSize(t.pending), 'freed, waiting for other streams: ' + fmtBytes(t.pending)) : '') +
      chip('Free (cached)', fmtSize(t.free), fmtBytes(t.free)) +
      chip('Largest free block', fmtSize(t.largest), fmtBytes(t.largest)) +
      chip('Fragmentation', pct(t.frag), '1 - largest free block / free bytes') +
      chip('Live blocks', fmtInt(t.live)) +
      (st.orphans ? chip('Outside segments', fmtInt(st.orphans), 'live blocks in no segment the trace knows: a partial trace') : '') +
      '</div>';
  }

  // ---- event list (virtual: only the visible rows exist)
  geometry() {
    const N = this.d.N, viewH = this.list.clientHeight;
    const total = N * ROW_H;
    const spacerH = Math.min(total, MAX_SCROLL_PX);
    const visibleRows = Math.max(1, Math.floor(viewH / ROW_H));
    const scrollMax = Math.max(0, spacerH - viewH);
    const firstMax = Math.max(0, N - viewH / ROW_H);
    return { N, viewH, spacerH, visibleRows, scrollMax, firstMax };
  }
  renderRows() {
    const d = this.d, g = this.geometry();
    this.spacer.style.height = g.spacerH + 'px';
    const first = g.scrollMax > 0 ? (this.list.scrollTop / g.scrollMax) * g.firstMax : 0;
    const i0 = Math.floor(first), offset = (first - i0) * ROW_H;
    const count = Math.min(g.N - i0, Math.ceil(g.viewH / ROW_H) + 1);
    while (this.rowPool.length < count) {
      const row = document.createElement('div');
      row.className = 'ev-row';
      row.setAttribute('role', 'option');
      row.innerHTML = '<span class="idx"></span><span class="act"></span><span class="addr"></span><span class="size"></span>';
      this.rowsEl.appendChild(row);
      this.rowPool.push(row);
    }
    const multiStream = d.meta.streams.length > 1;
    for (let k = 0; k < this.rowPool.length; k++) {
      const row = this.rowPool[k];
      if (k >= count) { row.hidden = true; continue; }
      const e = i0 + k;
      row.hidden = false;
      row.style.top = (k * ROW_H - offset) + 'px';
      row.dataset.idx = e;
      const kind = d.evKind[e];
      const c = row.children;
      c[0].textContent = '#' + e;
      c[1].textContent = EVENT_NAMES[kind];
      c[1].className = 'act act-' + EVENT_NAMES[kind];
      if (kind === EV_OOM) {
        c[2].textContent = 'device had ' + fmtSize(d.evAddr[e]) + ' free';
      } else if (kind === EV_SNAPSHOT) {
        c[2].textContent = '';
      } else {
        c[2].textContent = hex(d.evAddr[e]) + (multiStream ? '  s' + d.streamName(d.evStream[e]) : '');
      }
      c[3].textContent = fmtSize(d.evSize[e]);
      row.title = d.eventLine(e) + (d.hasTime ? '  (+' + fmtDuration(d.time(e)) + ')' : '') + '  trace entry ' + d.evEntry[e];
      const sel = e === this.sel;
      row.classList.toggle('sel', sel);
      row.setAttribute('aria-selected', sel ? 'true' : 'false');
      row.classList.toggle('match', !!this.matches && this.isMatch(e));
    }
  }
  // Keeps the selection in view: a step past an edge scrolls by that step, a jump
  // elsewhere centres it.
  scrollToSel() {
    const g = this.geometry();
    if (g.scrollMax <= 0) return;
    const first = (this.list.scrollTop / g.scrollMax) * g.firstMax;
    let want = first;
    if (this.sel < first - g.visibleRows || this.sel > first + 2 * g.visibleRows) want = this.sel - g.visibleRows / 2;
    else if (this.sel < first + 1) want = this.sel - 1;
    else if (this.sel > first + g.visibleRows - 2) want = this.sel - g.visibleRows + 2;
    if (want !== first) this.list.scrollTop = (clamp(want, 0, g.firstMax) / Math.max(1e-9, g.firstMax)) * g.scrollMax;
  }
  onKey(ev) {
    const g = this.geometry();
    const moves = { ArrowDown: 1, ArrowUp: -1, PageDown: g.visibleRows, PageUp: -g.visibleRows };
    let target = null;
    if (ev.key in moves) target = this.sel + moves[ev.key];
    else if (ev.key === 'Home') target = 0;
    else if (ev.key === 'End') target = this.d.N - 1;
    else if (ev.key === 'Enter' && this.matches) { this.stepMatch(ev.shiftKey ? -1 : 1); ev.preventDefault(); return; }
    if (target === null) return;
    ev.preventDefault();
    this.select(target);
  }

  // ---- search: events whose block or segment contains an address, or "#123"
  runSearch(text) {
    const d = this.d, status = $('ev-search-status');
    this.query = text;
    const q = text.trim().toLowerCase();
    this.matches = null;
    this.matchPos = -1;
    if (!q) {
      status.textContent = 'Events whose block or segment contains the address.';
      this.renderRows();
      return;
    }
    if (q[0] === '#') {
      const e = parseInt(q.slice(1).replace(/,/g, ''), 10);
      if (isFinite(e)) { status.textContent = 'Event #' + fmtInt(clamp(e, 0, d.N - 1)); this.select(e); }
      return;
    }
    const digits = q.replace(/^0x/, '').replace(/^b'?/, '').replace(/_.*$/, '');
    if (!/^[0-9a-f]+$/.test(digits)) { status.textContent = 'Type a hex address (0x7f3a\u2026) or #event.'; this.renderRows(); return; }
    const v = parseInt(digits, 16);
    const out = [];
    for (let e = 0; e < d.N; e++) {
      const k = d.evKind[e];
      if (k === EV_OOM || k === EV_SNAPSHOT) continue;
      const a = d.evAddr[e];
      if (a <= v && v < a + Math.max(1, d.evSize[e])) out.push(e);
    }
    let how = 'containing ' + hex(v);
    if (out.length === 0 && digits.length < 12) {
      // Not a full address: fall back to events whose address contains the digits.
      for (let e = 0; e < d.N; e++) {
        const k = d.evKind[e];
        if (k !== EV_OOM && k !== EV_SNAPSHOT && d.evAddr[e].toString(16).includes(digits)) out.push(e);
      }
      how = 'whose address contains "' + digits + '"';
    }
    this.matches = Int32Array.from(out);
    status.textContent = out.length ? fmtInt(out.length) + ' events ' + how + ' \u00b7 Enter: next' : 'No event ' + how + '.';
    this.renderRows();
  }
  isMatch(e) {
    const m = this.matches, i = lowerBound(m, e);
    return i < m.length && m[i] === e;
  }
  stepMatch(dir) {
    const m = this.matches;
    if (!m || m.length === 0) return;
    let i;
    if (dir > 0) { i = lowerBound(m, this.sel + 1); if (i >= m.length) i = 0; } else { i = lowerBound(m, this.sel) - 1; if (i < 0) i = m.length - 1; }
    this.matchPos = i;
    $('ev-search-status').textContent = 'Match ' + fmtInt(i + 1) + ' of ' + fmtInt(m.length) + ' \u00b7 ' + this.d.eventLine(m[i]);
    const e = m[i];
    // Point at the allocation the event is about, if any.
    const a = this.d.evAlloc[e];
    this.select(e, { alloc: a >= 0 ? a : -1 });
  }

  // ---- segments
  layoutSegments() {
    const dpr = window.devicePixelRatio || 1;
    const w = this.scroll.clientWidth, h = this.scroll.clientHeight;
    if (this.canvas.width !== Math.round(w * dpr) || this.canvas.height !== Math.round(h * dpr)) {
      this.canvas.width = Math.round(w * dpr);
      this.canvas.height = Math.round(h * dpr);
      this.canvas.style.height = h + 'px';
    }
    this.dpr = dpr;
    return { w, h };
  }
  drawSegments() {
    if (!this.state || !this.visible()) return;
    const { w, h } = this.layoutSegments();
    const ctx = this.ctx, d = this.d, segs = this.state.segments, dpr = this.dpr;
    $('st-spacer').style.height = Math.max(h, segs.length * SEG_ROW_H + 8) + 'px';
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    if (segs.length === 0) {
      ctx.fillStyle = '#6b7383';
      ctx.font = '13px system-ui, sans-serif';
      ctx.fillText('No segments are held after this event.', 12, 24);
      return;
    }
    const maxSize = segs.reduce((m, g) => Math.max(m, g.size), 0);
    const top = this.scroll.scrollTop;
    const first = Math.floor(top / SEG_ROW_H), last = Math.min(segs.length, Math.ceil((top + h) / SEG_ROW_H));
    const barX = 10, barW = w - 20;
    this.barGeom = { barX, barW, maxSize };
    for (let r = first; r < last; r++) {
      const g = segs[this.orderIdx[r]];
      const y = r * SEG_ROW_H - top;
      ctx.font = '12px ui-monospace, Menlo, Consolas, monospace';
      ctx.fillStyle = '#1d2330';
      ctx.textBaseline = 'alphabetic';
      ctx.textAlign = 'left';
      const type = (g.small ? 'small' : 'large') + (g.expandable ? ' expandable' : '');
      const streamText = d.meta.streams.length > 1 || d.streamName(g.stream) !== '0' ? '  stream ' + d.streamName(g.stream) : '';
      ctx.fillText(hex(g.addr) + '  ' + fmtSize(g.size) + '  ' + type + streamText, barX, y + 14);
      ctx.textAlign = 'right';
      ctx.font = '12px system-ui, sans-serif';
      ctx.fillStyle = '#6b7383';
      ctx.fillText('allocated ' + fmtSize(g.allocated) + (g.pending ? ' \u00b7 pending ' + fmtSize(g.pending) : '') + ' \u00b7 free ' + fmtSize(g.free) +
        ' \u00b7 largest free ' + fmtSize(g.largest) + ' \u00b7 fragmentation ' + pct(g.frag), barX + barW, y + 14);
      this.drawBar(ctx, g, barX, y + 19, this.trueScale ? (barW * g.size) / maxSize : barW, 14);
    }
  }
  // One segment's bar: blocks in address order, the largest free block outlined.
  drawBar(ctx, g, x, y, w, h) {
    const d = this.d, scale = w / g.size;
    ctx.fillStyle = FREE_COLOR;
    ctx.fillRect(x, y, w, h);
    for (const b of g.blocks) {
      if (b.a < 0) continue;
      const bx = x + (b.addr - g.addr) * scale, bw = b.size * scale, rw = b.req * scale;
      if (b.pending) {
        ctx.fillStyle = pendingPattern(ctx);
        ctx.fillRect(bx, y, Math.max(bw, 0.5), h);
      } else {
        ctx.fillStyle = PALETTE[colorIndex(b.a)];
        ctx.fillRect(bx, y, Math.max(rw, 0.5), h);
        if (bw - rw > 0.3) { ctx.fillStyle = slackPattern(ctx); ctx.fillRect(bx + rw, y, bw - rw, h); }
      }
      if (b.a === this.highlightAlloc) { ctx.strokeStyle = '#111'; ctx.lineWidth = 2; ctx.strokeRect(bx - 1, y - 1, Math.max(bw, 1) + 2, h + 2); }
      if (bw > 4) { ctx.fillStyle = 'rgba(255,255,255,0.9)'; ctx.fillRect(bx + bw - 0.5, y, 0.5, h); }
    }
    ctx.strokeStyle = '#b9c0cc';
    ctx.lineWidth = 1;
    ctx.strokeRect(x + 0.5, y + 0.5, w - 1, h - 1);
    if (g.largestBlock) {
      const b = g.largestBlock;
      ctx.strokeStyle = LARGEST_COLOR;
      ctx.lineWidth = 2;
      ctx.strokeRect(x + (b.addr - g.addr) * scale + 1, y + 1, Math.max(1, b.size * scale - 2), h - 2);
    }
    if (this.hoverBlock && this.hoverBlock.g === g) {
      const b = this.hoverBlock.block;
      ctx.strokeStyle = '#1d2330';
      ctx.lineWidth = 1;
      ctx.strokeRect(x + (b.addr - g.addr) * scale - 0.5, y - 1.5, Math.max(1, b.size * scale) + 1, h + 3);
    }
  }
  segHit(ev) {
    if (!this.state || !this.barGeom) return null;
    const r = this.canvas.getBoundingClientRect();
    const x = ev.clientX - r.left, y = ev.clientY - r.top + this.scroll.scrollTop;
    const row = Math.floor(y / SEG_ROW_H);
    if (row < 0 || row >= this.state.segments.length) return null;
    const g = this.state.segments[this.orderIdx[row]];
    const { barX, barW, maxSize } = this.barGeom;
    const w = this.trueScale ? (barW * g.size) / maxSize : barW;
    const yIn = y - row * SEG_ROW_H;
    if (x < barX || x > barX + w || yIn < 17 || yIn > 35) return { g, block: null };
    const addr = g.addr + ((x - barX) / w) * g.size;
    // Blocks are in address order: the last one starting at or before addr.
    let lo = 0, hi = g.blocks.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (g.blocks[mid].addr <= addr) lo = mid; else hi = mid - 1; }
    return { g, block: g.blocks[lo] };
  }
  onSegMove(ev) {
    const h = this.segHit(ev);
    const prev = this.hoverBlock;
    this.hoverBlock = h && h.block ? h : null;
    if ((prev && prev.block) !== (this.hoverBlock && this.hoverBlock.block)) this.drawSegments();
    if (!h) { tooltip.hide(); return; }
    tooltip.show(h.block ? this.blockHtml(h.g, h.block, 8) : this.segmentHtml(h.g), ev.clientX, ev.clientY);
  }
  segmentHtml(g) {
    const d = this.d;
    const rows = [['Address', hex(g.addr) + ' \u2013 ' + hex(g.addr + g.size)], ['Size', fmtSizeFull(g.size)],
      ['Pool', (g.small ? 'small' : 'large') + (g.expandable ? ', expandable (mapped pages)' : '')], ['Stream', d.streamName(g.stream)],
      ['Allocated', fmtSizeFull(g.allocated)], ['Pending free', fmtSize(g.pending)], ['Free', fmtSizeFull(g.free)],
      ['Largest free block', fmtSize(g.largest)], ['Fragmentation', pct(g.frag) + ' (1 - largest free / free)'], ['Blocks', fmtInt(g.blocks.length)]];
    return '<b>Segment</b><dl class="kv">' + rows.map(([k, v]) => '<dt>' + k + '</dt><dd>' + esc(v) + '</dd>').join('') + '</dl>' +
      (g.stack >= 0 ? '<div class="muted">Allocated from the device at:</div>' + framesHtml(d.stack(g.stack), 8) : '');
  }
  blockHtml(g, b, maxFrames) {
    if (b.a < 0) {
      const largest = b === g.largestBlock;
      return '<b>Free block</b> ' + fmtSizeFull(b.size) + '<dl class="kv"><dt>Address</dt><dd>' + hex(b.addr) + '</dd><dt>Segment</dt><dd>' + hex(g.addr) + ' (' + fmtSize(g.size) + ')</dd></dl>' +
        (largest ? '<div>The largest free block of this segment.</div>' : '');
    }
    let html = b.pending ? '<div style="color:#ffb3b0"><b>Pending free</b>: freed by the program, waiting for work on other streams (record_stream)</div>' : '';
    html += allocationHtml(this.d, b.a, { maxFrames, full: maxFrames > 8 });
    if (b.size > b.req) html += '<div class="muted">' + fmtSize(b.size - b.req) + ' of its block is rounding or an unsplit remainder.</div>';
    return html;
  }
  showDetails() {
    const el = $('st-details'), p = this.pinnedBlock;
    if (!p) { el.innerHTML = '<p class="muted">Hover a block for details; click to pin it here.</p>'; return; }
    const b = p.block, d = this.d;
    let actions = '';
    if (b.a >= 0) {
      actions = '<div class="actions"><button data-act="timeline">Show on the timeline</button>' +
        (d.alStart[b.a] >= 0 ? '<button data-act="alloc">Go to its alloc (#' + fmtInt(d.alStart[b.a]) + ')</button>' : '') +
        (d.alEnd[b.a] < d.N ? '<button data-act="free">Go to its free (#' + fmtInt(d.alEnd[b.a]) + ')</button>' : '') + '</div>';
    }
    el.innerHTML = actions + this.blockHtml(p.g, b, 60) + '<hr>' + this.segmentHtml(p.g);
    const on = (act, fn) => { const x = el.querySelector('[data-act=' + act + ']'); if (x) x.onclick = fn; };
    on('timeline', () => this.app.openTimelineAlloc(b.a));
    on('alloc', () => this.select(d.alStart[b.a], { alloc: b.a }));
    on('free', () => this.select(d.alEnd[b.a], { alloc: b.a }));
  }
  scrollToAlloc(a) {
    const segs = this.state.segments, addr = this.d.alAddr[a];
    for (let r = 0; r < this.orderIdx.length; r++) {
      const g = segs[this.orderIdx[r]];
      if (g.addr <= addr && addr < g.addr + g.size) {
        const h = this.scroll.clientHeight;
        const y = r * SEG_ROW_H;
        if (y < this.scroll.scrollTop || y + SEG_ROW_H > this.scroll.scrollTop + h) this.scroll.scrollTop = Math.max(0, y - h / 3);
        this.drawSegments();
        return;
      }
    }
  }
}

let slackPat = null, pendingPat = null;
function stripes(ctx, a, b, step) {
  const c = document.createElement('canvas');
  c.width = c.height = step * 2;
  const x = c.getContext('2d');
  x.fillStyle = b; x.fillRect(0, 0, step * 2, step * 2);
  x.strokeStyle = a; x.lineWidth = step * 0.7;
  x.beginPath();
  for (let i = -2; i <= 2; i++) { x.moveTo(i * step * 2, step * 2); x.lineTo(i * step * 2 + step * 2, 0); }
  x.stroke();
  return ctx.createPattern(c, 'repeat');
}
const slackPattern = (ctx) => slackPat || (slackPat = stripes(ctx, '#9db7da', '#dbe6f4', 3));
const pendingPattern = (ctx) => pendingPat || (pendingPat = stripes(ctx, '#e15759', '#f6c1c1', 4));
