// ccalloc memory viewer. Embedded into one HTML file by `ccalloc viz` with its data (see
// viz/page.hpp for the payload and viz/model.hpp for what the columns mean). No libraries
// and no requests: canvas 2D drawing into pixel buffers, typed arrays throughout, so a
// trace of a million entries loads in about a second and pans at frame rate.
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
//                   src/core/oom_ladder.cpp) and the replays that test alternative configs.
//   Summary         memory_summary(), peaks, settings.
(function () {
  'use strict';

  const viz = (window.__viz = {
    ready: false,        // the first timeline frame is on screen
    firstFrameMs: null,  // performance.now() at that moment (ms since navigation start)
    loadMs: null,        // payload decoded and indexed
    error: null,
    renders: 0,
    lastRenderMs: 0,
  });

  // ---------------------------------------------------------------------------------------
  // Constants shared with viz/model.hpp

  const EV_ALLOC = 0, EV_FREE_REQUESTED = 1, EV_FREE_COMPLETED = 2, EV_FREE = 3;
  const EV_SEGMENT_ALLOC = 4, EV_SEGMENT_FREE = 5, EV_SEGMENT_MAP = 6, EV_SEGMENT_UNMAP = 7;
  const EV_SNAPSHOT = 8, EV_OOM = 9;
  const EVENT_NAMES = ['alloc', 'free_requested', 'free_completed', 'free', 'segment_alloc',
    'segment_free', 'segment_map', 'segment_unmap', 'snapshot', 'oom'];
  const AL_BEFORE_TRACE = 1, AL_STACK_FROM_FREE = 2;
  const SP_SMALL = 1, SP_EXPANDABLE = 2, SP_TYPE_KNOWN = 4;

  // Band colours (Tableau-like, without reds: red means pending free and OOM).
  const PALETTE = ['#4e79a7', '#f28e2b', '#76b7b2', '#59a14f', '#edc948', '#b07aa1', '#ff9da7',
    '#9c755f', '#86bcb6', '#a0cbe8', '#ffbe7d', '#8cd17d', '#f1ce63', '#d4a6c8', '#499894',
    '#b6992d', '#79706e', '#6b9ac4'];
  const REST_COLOR = '#b8bec8', CACHED_COLOR = '#e3ebf7', RESERVED_COLOR = '#1f4e99';
  const OOM_COLOR = '#d43f3a', FREE_COLOR = '#ffffff', LARGEST_COLOR = '#2e8b57';

  // ---------------------------------------------------------------------------------------
  // Formatting

  const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  function fmtSize(n) {
    if (!isFinite(n)) return '-';
    const neg = n < 0;
    let v = Math.abs(n), u = 0;
    while (v >= 1024 && u < UNITS.length - 1) { v /= 1024; u++; }
    const s = u === 0 ? String(Math.round(v)) : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
    return (neg ? '-' : '') + s + ' ' + UNITS[u];
  }
  // Axis labels: as few digits as the tick step needs ("2 GiB", "1.5 GiB").
  function fmtTick(n) {
    let v = n, u = 0;
    while (v >= 1024 && u < UNITS.length - 1) { v /= 1024; u++; }
    return (+v.toFixed(2)).toString() + ' ' + UNITS[u];
  }
  const fmtInt = (n) => Math.round(n).toLocaleString('en-US');
  const fmtBytes = (n) => fmtInt(n) + ' B';
  const fmtSizeFull = (n) => fmtSize(n) + ' (' + fmtBytes(n) + ')';
  const hex = (n) => '0x' + n.toString(16);
  const pct = (x) => (100 * x).toFixed(1) + '%';
  function fmtDuration(us) {
    const a = Math.abs(us);
    if (a < 1000) return Math.round(us) + ' \u00b5s';
    if (a < 1e6) return (us / 1e3).toFixed(a < 1e4 ? 2 : 1) + ' ms';
    if (a < 6e7) return (us / 1e6).toFixed(3) + ' s';
    const m = Math.floor(a / 6e7);
    return (us < 0 ? '-' : '') + m + ' min ' + ((a - m * 6e7) / 1e6).toFixed(1) + ' s';
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
  }
  function hexToRgb(h) {
    const v = parseInt(h.slice(1), 16);
    return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
  }
  // ImageData pixels are RGBA bytes: as a little-endian Uint32 that is 0xAABBGGRR.
  function rgba32(h, alpha = 255) {
    const [r, g, b] = hexToRgb(h);
    return ((alpha << 24) | (b << 16) | (g << 8) | r) >>> 0;
  }
  const PALETTE32 = PALETTE.map((c) => rgba32(c));
  const colorIndex = (a) => (a * 7) % PALETTE.length;  // consecutive allocations differ

  // First index i with arr[i] >= x (arr ascending).
  function lowerBound(arr, x, lo = 0, hi = arr.length) {
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (arr[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
  }
  const clamp = (x, lo, hi) => Math.max(lo, Math.min(hi, x));
  const $ = (id) => document.getElementById(id);

  // ---------------------------------------------------------------------------------------
  // Payload

  async function loadPayload() {
    const meta = JSON.parse($('ccalloc-meta').textContent);
    const b64 = $('ccalloc-data').textContent.trim();
    let bytes;
    if (typeof Uint8Array.fromBase64 === 'function') {
      bytes = Uint8Array.fromBase64(b64);
    } else {
      const bin = atob(b64);
      bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    }
    // The browser's own gzip decoder: no library, and no request (a Blob's stream).
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    const buf = await new Response(stream).arrayBuffer();
    const cols = {};
    for (const [name, [type, offset, length, hiOffset]] of Object.entries(meta.columns)) {
      if (type === 'u8') cols[name] = new Uint8Array(buf, offset, length);
      else if (type === 'u16') cols[name] = new Uint16Array(buf, offset, length);
      else if (type === 'i32') cols[name] = new Int32Array(buf, offset, length);
      else if (type === 'u64' || type === 'i64') {
        const lo = new Uint32Array(buf, offset, length);
        const hi = type === 'u64' ? new Uint32Array(buf, hiOffset, length) : new Int32Array(buf, hiOffset, length);
        const out = new Float64Array(length);
        for (let i = 0; i < length; i++) out[i] = hi[i] * 4294967296 + lo[i];
        cols[name] = out;
      } else {
        throw new Error('unknown column type ' + type + ' of ' + name);
      }
    }
    return { meta, cols };
  }

  // ---------------------------------------------------------------------------------------
  // Data: the columns plus what every view derives from them

  class Data {
    constructor(meta, c) {
      this.meta = meta;
      const N = (this.N = c.ev_kind.length);
      const A = (this.A = c.al_start.length);
      const S = (this.S = c.sp_start.length);
      this.evKind = c.ev_kind; this.evAddr = c.ev_addr; this.evSize = c.ev_size;
      this.evStream = c.ev_stream; this.evTime = c.ev_time; this.evStack = c.ev_stack;
      this.evAlloc = c.ev_alloc; this.evEntry = c.ev_entry;
      this.alStart = c.al_start; this.alFreeReq = c.al_free_requested; this.alEnd = c.al_end;
      this.alAddr = c.al_addr; this.alSize = c.al_size; this.alBlock = c.al_block_size;
      this.alSlack = c.al_slack; this.alStack = c.al_stack; this.alStream = c.al_stream;
      this.alFlags = c.al_flags;
      this.spStart = c.sp_start; this.spEnd = c.sp_end; this.spAddr = c.sp_addr; this.spSize = c.sp_size;
      this.spStack = c.sp_stack; this.spStream = c.sp_stream; this.spFlags = c.sp_flags;

      // The allocations that start and end at each event (an end may be shared only in an
      // inconsistent trace: those go to extraEnds).
      this.startAt = new Int32Array(N).fill(-1);
      this.endAt = new Int32Array(N).fill(-1);
      this.extraEnds = new Map();
      // Live requested bytes and reserved bytes after each event, from interval deltas.
      const reqDelta = new Float64Array(N + 1), resDelta = new Float64Array(N + 1);
      let req0 = 0, res0 = 0;
      for (let a = 0; a < A; a++) {
        const s = this.alStart[a], e = this.alEnd[a], size = this.alSize[a];
        if (s >= 0) { this.startAt[s] = a; reqDelta[s] += size; } else req0 += size;
        if (e >= 0 && e < N) {
          reqDelta[e] -= size;
          if (this.endAt[e] < 0) this.endAt[e] = a;
          else { if (!this.extraEnds.has(e)) this.extraEnds.set(e, []); this.extraEnds.get(e).push(a); }
        } else if (e < 0) req0 -= size;
      }
      for (let s = 0; s < S; s++) {
        const st = this.spStart[s], e = this.spEnd[s], size = this.spSize[s];
        if (st >= 0) resDelta[st] += size; else res0 += size;
        if (e >= 0 && e < N) resDelta[e] -= size; else if (e < 0) res0 -= size;
      }
      this.reqInit = req0; this.resInit = res0;
      const liveReq = (this.liveReq = new Float64Array(N));
      const reserved = (this.reserved = new Float64Array(N));
      let req = req0, res = res0;
      this.peakReq = { bytes: req0, event: -1 };
      this.peakRes = { bytes: res0, event: -1 };
      for (let e = 0; e < N; e++) {
        req += reqDelta[e]; res += resDelta[e];
        liveReq[e] = req; reserved[e] = res;
        if (req > this.peakReq.bytes) this.peakReq = { bytes: req, event: e };
        if (res > this.peakRes.bytes) this.peakRes = { bytes: res, event: e };
      }
      this.maxY = Math.max(this.peakReq.bytes, this.peakRes.bytes, 1);
      this.hasTime = N > 1 && this.evTime[N - 1] > this.evTime[0];
      this.ooms = meta.ooms || [];
      this.colors = new Uint32Array(A);
      for (let a = 0; a < A; a++) this.colors[a] = PALETTE32[colorIndex(a)];
      const st = meta.stacks;
      this.strings = st.strings; this.frames = st.frames; this.stacks = st.stacks;
      this.expandable = /expandable_segments:True/.test(meta.conf || '');
    }

    // A stack as [{name, file, line}], innermost first.
    stack(id) {
      if (id < 0 || id >= this.stacks.length) return [];
      return this.stacks[id].map((f) => {
        const [file, line, name] = this.frames[f];
        return { name: this.strings[name], file: this.strings[file], line };
      });
    }
    eventLine(e) {
      if (e < 0) return 'before the first event';
      const k = this.evKind[e];
      const name = EVENT_NAMES[k];
      if (k === EV_OOM) {
        return 'oom: requested ' + fmtSize(this.evSize[e]) + ', device had ' + fmtSize(this.evAddr[e]) + ' free';
      }
      if (k === EV_SNAPSHOT) return 'snapshot';
      return name + ' ' + hex(this.evAddr[e]) + ' ' + fmtSize(this.evSize[e]);
    }
    streamName(i) { return this.meta.streams[i] !== undefined ? this.meta.streams[i] : '?'; }
    time(e) { return e >= 0 && e < this.N ? this.evTime[e] : 0; }
  }

  // PyTorch's viewer hides frames of the interpreter and the dispatcher (frameFilter).
  const HIDDEN_NAMES = ['unwind::unwind', 'CapturedTraceback::gather', 'gather_with_cpp', '_start',
    '__libc_start_main', 'PyEval_', 'PyObject_', 'PyFunction_'];
  const HIDDEN_FILES = ['core/boxing', '/Register', '/Redispatch', 'pythonrun.c', 'Modules/main.c',
    'Objects/call.c', 'Objects/methodobject.c', 'pycore_ceval.h', 'ceval.c', 'cpython/abstract.h'];
  function visibleFrames(frames) {
    return frames.filter((f) => !HIDDEN_NAMES.some((n) => f.name.includes(n)) &&
      !HIDDEN_FILES.some((n) => f.file.includes(n)));
  }
  // A list of frames with repeats elided; `max` frames at most.
  function framesHtml(frames, max = Infinity, all = false) {
    const shown = all ? frames : visibleFrames(frames);
    if (frames.length === 0) {
      return '<p class="muted">No stack recorded: record history with stacks (context "alloc" or "all") to see where it was allocated.</p>';
    }
    const items = [];
    for (let i = 0; i < shown.length && items.length < max; i++) {
      let j = i;
      while (j + 1 < shown.length && shown[j + 1].name === shown[i].name && shown[j + 1].file === shown[i].file &&
             shown[j + 1].line === shown[i].line) j++;
      const f = shown[i];
      const loc = f.file ? f.file + (f.line ? ':' + f.line : '') : '';
      items.push('<li><span class="fn">' + esc(f.name || '??') + '</span>  <span class="loc">' + esc(loc) + '</span></li>');
      if (j > i) items.push('<li class="elided">&lt;repeats ' + (j - i) + ' times&gt;</li>');
      i = j;
    }
    const hidden = frames.length - shown.length;
    let more = '';
    if (shown.length > max) more = '<li class="elided">\u2026 ' + (shown.length - max) + ' more frames</li>';
    if (hidden > 0 && !all) more += '<li class="elided">' + hidden + ' interpreter frames hidden</li>';
    return '<ul class="frames">' + items.join('') + more + '</ul>';
  }

  // ---------------------------------------------------------------------------------------
  // Timeline layout: which allocations get a band, and the live list of those over time

  const CHECKPOINT_EVERY = 4096;

  class Layout {
    constructor(d, K) {
      const A = d.A, N = d.N;
      this.d = d;
      this.K = K = Math.min(K, A);
      const isK = (this.isK = new Uint8Array(A));
      this.minSize = 0;
      if (K >= A) {
        isK.fill(1);
      } else if (K > 0) {
        const sorted = Float64Array.from(d.alSize).sort();
        const threshold = sorted[A - K];
        let above = 0;
        for (let a = 0; a < A; a++) if (d.alSize[a] > threshold) { isK[a] = 1; above++; }
        let ties = K - above;
        for (let a = 0; a < A && ties > 0; a++) if (d.alSize[a] === threshold) { isK[a] = 1; ties--; }
        this.minSize = threshold;
      }
      // Bytes of live allocations without a band, after each event: one grey band.
      const delta = new Float64Array(N + 1);
      let rest0 = 0;
      for (let a = 0; a < A; a++) {
        if (isK[a]) continue;
        const s = d.alStart[a], e = d.alEnd[a], size = d.alSize[a];
        if (s >= 0) delta[s] += size; else rest0 += size;
        if (e >= 0 && e < N) delta[e] -= size;
      }
      this.restInit = rest0;
      const rest = (this.rest = new Float64Array(N));
      let r = rest0;
      for (let e = 0; e < N; e++) { r += delta[e]; rest[e] = r; }

      // The live list, in stack order (allocation index order, which is alloc order: a new
      // allocation always goes on top).
      this.HEAD = A;
      this.next = new Int32Array(A + 1);
      this.prev = new Int32Array(A + 1);
      this.inList = new Uint8Array(A);
      this.next[A] = A; this.prev[A] = A;  // the empty list
      this.initial = [];
      for (let a = 0; a < A && d.alStart[a] < 0; a++) if (isK[a] && d.alEnd[a] >= 0) this.initial.push(a);
      // Checkpoints: the list before event j * CHECKPOINT_EVERY.
      this.checkpoints = [];
      this.load(this.initial);
      this.pos = 0;
      this.maxDepth = 0;
      let depth = this.initial.length;
      for (let e = 0; e < N; e++) {
        if (e % CHECKPOINT_EVERY === 0) this.checkpoints.push(this.list());
        depth += this.apply(e);
        if (depth > this.maxDepth) this.maxDepth = depth;
      }
      this.pos = N;
    }
    clear() {
      const H = this.HEAD;
      for (let a = this.next[H]; a !== H; a = this.next[a]) this.inList[a] = 0;
      this.next[H] = H; this.prev[H] = H;
    }
    load(list) {
      this.clear();
      for (let i = 0; i < list.length; i++) this.append(list[i]);
    }
    list() {
      const out = [];
      for (let a = this.next[this.HEAD]; a !== this.HEAD; a = this.next[a]) out.push(a);
      return Int32Array.from(out);
    }
    append(a) {
      const H = this.HEAD, t = this.prev[H];
      this.next[t] = a; this.prev[a] = t; this.next[a] = H; this.prev[H] = a; this.inList[a] = 1;
    }
    unlink(a) {
      if (!this.inList[a]) return 0;
      const p = this.prev[a], n = this.next[a];
      this.next[p] = n; this.prev[n] = p; this.inList[a] = 0;
      return 1;
    }
    // Applies event e; returns the change in list length.
    apply(e) {
      const d = this.d;
      let change = 0;
      const x = d.endAt[e];
      if (x >= 0 && this.isK[x]) change -= this.unlink(x);
      if (d.extraEnds.size && d.extraEnds.has(e)) for (const y of d.extraEnds.get(e)) if (this.isK[y]) change -= this.unlink(y);
      const s = d.startAt[e];
      if (s >= 0 && this.isK[s] && !this.inList[s]) { this.append(s); change++; }
      return change;
    }
    // Moves to the state after event `target` (-1: before the first event).
    seek(target) {
      const want = target + 1;
      if (want < this.pos || want - this.pos > CHECKPOINT_EVERY) {
        const j = Math.min(Math.floor(want / CHECKPOINT_EVERY), this.checkpoints.length - 1);
        if (j >= 0) { this.load(this.checkpoints[j]); this.pos = j * CHECKPOINT_EVERY; }
        else { this.load(this.initial); this.pos = 0; }
      }
      while (this.pos < want) this.apply(this.pos++);
    }
  }

  // How many allocations get their own band: all of them unless they stack deeper than
  // MAX_DEPTH at some moment (a column costs one step per live band); then the largest
  // 20,000, halved until they do not.
  const MAX_DEPTH = 3000;
  function chooseLayout(d) {
    let K = d.A;
    let layout = new Layout(d, K);
    while (layout.maxDepth > MAX_DEPTH && K > 1000) {
      K = K > 20000 ? 20000 : Math.floor(K / 2);
      layout = new Layout(d, K);
    }
    return layout;
  }
  function detailOptions(d) {
    const opts = [1000, 2000, 5000, 10000, 20000, 50000].filter((k) => k < d.A);
    opts.push(d.A);
    return opts;
  }

  // ---------------------------------------------------------------------------------------
  // Nice axis ticks

  function byteTicks(max, count) {
    if (max <= 0) return [0];
    const raw = max / count;
    let unit = 1;
    while (unit * 1024 <= raw) unit *= 1024;
    const steps = [1, 2, 4, 5, 10, 20, 25, 50, 100, 128, 200, 250, 256, 500, 512, 1024];
    let step = unit * 1024;
    for (const s of steps) if (s * unit >= raw) { step = s * unit; break; }
    const out = [];
    for (let v = 0; v <= max; v += step) out.push(v);
    return out;
  }
  function numberTicks(lo, hi, count) {
    const span = hi - lo;
    if (span <= 0) return [lo];
    const raw = span / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = mag * 10;
    for (const s of [1, 2, 2.5, 5, 10]) if (s * mag >= raw) { step = s * mag; break; }
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi; v += step) out.push(v);
    return out;
  }

  // ---------------------------------------------------------------------------------------
  // Tooltip

  const tooltip = {
    el: null,
    show(html, x, y) {
      const el = this.el || (this.el = $('tooltip'));
      el.innerHTML = html;
      el.hidden = false;
      const w = el.offsetWidth, h = el.offsetHeight;
      let left = x + 16, top = y + 16;
      if (left + w > window.innerWidth - 8) left = Math.max(8, x - w - 16);
      if (top + h > window.innerHeight - 8) top = Math.max(8, y - h - 16);
      el.style.left = left + 'px';
      el.style.top = top + 'px';
    },
    hide() { if (this.el) this.el.hidden = true; },
  };

  // What an allocation was: shared by the timeline and the state view.
  function allocationHtml(d, a, { maxFrames = 8, full = false } = {}) {
    const start = d.alStart[a], freed = d.alFreeReq[a], end = d.alEnd[a], N = d.N;
    const before = (d.alFlags[a] & AL_BEFORE_TRACE) !== 0;
    const rows = [];
    rows.push(['Address', hex(d.alAddr[a])]);
    rows.push(['Requested', fmtSizeFull(d.alSize[a])]);
    if (d.alBlock[a] !== d.alSize[a]) rows.push(['Block', fmtSize(d.alBlock[a]) + ' after rounding']);
    if (d.meta.streams.length > 1 || d.streamName(d.alStream[a]) !== '0') rows.push(['Stream', d.streamName(d.alStream[a])]);
    const at = (e) => '#' + fmtInt(e) + (d.hasTime ? ' (+' + fmtDuration(d.time(e)) + ')' : '');
    rows.push(['Allocated', before ? 'before the trace began' : at(start)]);
    if (freed >= 0 && freed < N && freed !== end) rows.push(['Free requested', at(freed)]);
    else if (freed < 0 && end < N) rows.push(['Free requested', 'before the trace began']);
    rows.push(['Freed', end < N ? at(end) : 'still live at the end']);
    if (!before) {
      const last = end < N ? end : N - 1;
      let life = fmtInt(last - start) + ' events';
      if (d.hasTime) life += ', ' + fmtDuration(d.time(last) - d.time(start));
      rows.push(['Lifetime', life + (end < N ? '' : ' (so far)')]);
    }
    const kv = '<dl class="kv">' + rows.map(([k, v]) => '<dt>' + k + '</dt><dd>' + esc(v) + '</dd>').join('') + '</dl>';
    const fromFree = (d.alFlags[a] & AL_STACK_FROM_FREE) !== 0;
    let html = '<div><b>' + fmtSize(d.alSize[a]) + '</b> allocation' + (before ? ' <span class="muted">(allocated before the trace)</span>' : '') + '</div>' + kv;
    html += '<div class="muted">' + (fromFree ? 'Stack of its free (the alloc was not recorded):' : 'Allocated at:') + '</div>';
    html += framesHtml(d.stack(d.alStack[a]), maxFrames);
    if (full && freed >= 0 && freed < N && !fromFree && d.evStack[freed] >= 0) {
      html += '<details><summary class="muted">Freed at</summary>' + framesHtml(d.stack(d.evStack[freed]), 40) + '</details>';
    }
    return html;
  }

  // ---------------------------------------------------------------------------------------
  // Timeline view

  const BG32 = rgba32('#ffffff');
  const REST32 = rgba32(REST_COLOR);
  const CACHED32 = rgba32(CACHED_COLOR);
  const SPAN_REST = -2, SPAN_CACHED = -3;

  class Timeline {
    constructor(app) {
      this.app = app;
      const d = (this.d = app.data);
      this.chart = $('tl-chart');
      this.canvas = $('tl-canvas');
      this.overlay = $('tl-overlay');
      this.overviewCanvas = $('tl-overview');
      this.ctx = this.canvas.getContext('2d', { alpha: false });
      this.octx = this.overlay.getContext('2d');
      this.mode = 'event';
      this.fitY = true;
      this.hover = null;     // hit under the pointer
      this.pinned = -1;      // pinned allocation
      this.mouse = null;     // {x, y} in CSS px, relative to the chart
      this.dirty = true;
      this.overlayDirty = true;
      this.frame = 0;
      this.margin = { l: 74, r: 14, t: 22, b: 34 };
      this.spans = { a: new Int32Array(1 << 16), r0: new Int32Array(1 << 16), r1: new Int32Array(1 << 16), n: 0 };

      const detail = $('tl-detail');
      for (const k of detailOptions(d)) {
        const o = document.createElement('option');
        o.value = k;
        o.textContent = k >= d.A ? 'all ' + fmtInt(d.A) : 'largest ' + fmtInt(k);
        detail.appendChild(o);
      }
      this.layout = chooseLayout(d);
      const K = this.layout.K;
      if (![...detail.options].some((o) => +o.value === K)) {
        const o = document.createElement('option');
        o.value = K; o.textContent = 'largest ' + fmtInt(K);
        detail.appendChild(o);
      }
      detail.value = String(K);
      this.updateLegend();
      detail.addEventListener('change', () => {
        this.layout = new Layout(d, +detail.value);
        this.updateLegend();
        this.invalidate();
      });
      const xaxis = $('tl-xaxis');
      if (!d.hasTime) { xaxis.querySelector('option[value=time]').disabled = true; xaxis.title = 'This trace has no timestamps'; }
      xaxis.addEventListener('change', () => this.setMode(xaxis.value));
      $('tl-fity').addEventListener('change', (ev) => { this.fitY = ev.target.checked; this.invalidate(); });
      $('tl-reset').addEventListener('click', () => this.resetView());
      if (d.N === 0) $('tl-empty').hidden = false;
      this.view = this.domain();
      this.installInput();
      new ResizeObserver(() => { if (this.visible()) { this.resize(); this.invalidate(); } }).observe(this.chart);
    }

    visible() { return this.chart.offsetParent !== null && this.chart.clientWidth > 0; }
    updateLegend() {
      const L = this.layout;
      $('tl-legend-rest').textContent = L.K >= this.d.A
        ? 'Summed band (empty: every allocation has its own)'
        : fmtInt(this.d.A - L.K) + ' allocations smaller than ' + fmtSize(L.minSize) + ', summed';
    }
    domain() {
      const d = this.d;
      if (this.mode === 'time') {
        const t0 = d.evTime[0], t1 = d.evTime[d.N - 1];
        return [t0, t1 + Math.max(1, (t1 - t0) / Math.max(1, d.N))];
      }
      return [0, Math.max(1, d.N)];
    }
    resetView() { this.view = this.domain(); this.invalidate(); }
    setMode(mode) {
      if (mode === this.mode) return;
      const d = this.d;
      const [a, b] = [this.view[0], this.view[1]];
      if (mode === 'time') {
        const e0 = clamp(Math.floor(a), 0, d.N - 1), e1 = clamp(Math.ceil(b) - 1, 0, d.N - 1);
        this.mode = 'time';
        this.view = [d.evTime[e0], Math.max(d.evTime[e1], d.evTime[e0] + 1)];
      } else {
        this.mode = 'event';
        this.view = [lowerBound(d.evTime, a), lowerBound(d.evTime, b)];
      }
      $('tl-xaxis').value = mode;
      this.clampView();
      this.overviewCache = null;
      this.invalidate();
    }
    clampView() {
      const [D0, D1] = this.domain();
      const full = D1 - D0;
      const minW = this.mode === 'event' ? Math.min(full, 8) : Math.min(full, Math.max(2, full / 1e7));
      let w = clamp(this.view[1] - this.view[0], minW, full);
      let x0 = clamp(this.view[0], D0, D1 - w);
      this.view = [x0, x0 + w];
    }
    // Shows event e (or an allocation's lifetime) in the middle of the view.
    focusEvents(e0, e1) {
      const d = this.d;
      e0 = clamp(e0, 0, Math.max(0, d.N - 1)); e1 = clamp(e1, e0, Math.max(0, d.N - 1));
      let x0, x1;
      if (this.mode === 'time') { x0 = d.evTime[e0]; x1 = d.evTime[e1]; } else { x0 = e0; x1 = e1 + 1; }
      const w = Math.max((x1 - x0) * 1.6, this.mode === 'time' ? 1 : 40);
      const mid = (x0 + x1) / 2;
      this.view = [mid - w / 2, mid + w / 2];
      this.clampView();
      this.invalidate();
    }
    pin(a) {
      this.pinned = a;
      this.showDetails();
      this.overlayDirty = true;
      this.schedule();
    }

    resize() {
      const dpr = window.devicePixelRatio || 1;
      const w = this.chart.clientWidth, h = this.chart.clientHeight;
      this.dpr = dpr;
      this.cssW = w; this.cssH = h;
      for (const c of [this.canvas, this.overlay]) {
        c.width = Math.max(1, Math.round(w * dpr));
        c.height = Math.max(1, Math.round(h * dpr));
      }
      const m = this.margin;
      this.pl = Math.round(m.l * dpr); this.pt = Math.round(m.t * dpr);
      this.pw = Math.max(1, this.canvas.width - this.pl - Math.round(m.r * dpr));
      this.ph = Math.max(1, this.canvas.height - this.pt - Math.round(m.b * dpr));
      this.image = this.ctx.createImageData(this.pw, this.ph);
      this.buf = new Uint32Array(this.image.data.buffer);
      this.colS = new Int32Array(this.pw);
      this.colRes = new Float64Array(this.pw);
      this.colSpan = new Int32Array(this.pw + 1);
      const ov = this.overviewCanvas;
      ov.width = Math.max(1, Math.round(ov.clientWidth * dpr));
      ov.height = Math.max(1, Math.round(ov.clientHeight * dpr));
      this.overviewCache = null;
    }
    invalidate() { this.dirty = true; this.overlayDirty = true; this.schedule(); }
    schedule() {
      if (this.frame) return;
      this.frame = requestAnimationFrame(() => {
        this.frame = 0;
        if (!this.visible()) return;
        if (!this.image) this.resize();
        if (this.dirty) this.render();
        if (this.overlayDirty) this.drawOverlay();
        this.drawOverview();
        if (!viz.ready) {
          viz.firstFrameMs = performance.now();
          viz.ready = true;
          $('loading').hidden = true;
        }
      });
    }

    // x (domain units) of column c's left edge.
    colX(c) { return this.view[0] + (c / this.pw) * (this.view[1] - this.view[0]); }
    // Device-px x of domain position x.
    xPix(x) { return this.pl + ((x - this.view[0]) / (this.view[1] - this.view[0])) * this.pw; }
    eventX(e) { return this.mode === 'time' ? this.d.evTime[e] : e + 0.5; }

    // Picks each column's event: the one where live memory peaks within the column.
    sampleColumns() {
      const d = this.d, N = d.N, pw = this.pw, colS = this.colS, colRes = this.colRes;
      const liveReq = d.liveReq, reserved = d.reserved, time = d.evTime;
      let top = 0;
      for (let c = 0; c < pw; c++) {
        const xa = this.colX(c), xb = this.colX(c + 1);
        let ea, eb;
        if (this.mode === 'time') {
          ea = lowerBound(time, xa);
          eb = lowerBound(time, xb, ea) - 1;
          if (eb < ea) { ea = eb = ea - 1; }  // no event here: the state persists
        } else {
          ea = Math.floor(xa); eb = Math.ceil(xb) - 1;
          if (eb < ea) eb = ea;
        }
        if (ea >= N || xb <= 0 || N === 0) { colS[c] = -2; colRes[c] = 0; continue; }
        ea = Math.max(ea, -1); eb = Math.min(eb, N - 1);
        if (eb < 0) { colS[c] = -1; colRes[c] = d.resInit; top = Math.max(top, d.resInit, d.reqInit); continue; }
        if (ea < 0) ea = 0;
        let s = ea, best = liveReq[ea], res = reserved[ea];
        for (let e = ea + 1; e <= eb; e++) {
          const v = liveReq[e];
          if (v > best) { best = v; s = e; }
          if (reserved[e] > res) res = reserved[e];
        }
        colS[c] = s; colRes[c] = res;
        if (res > top) top = res;
        if (best > top) top = best;
      }
      return top;
    }

    render() {
      const t0 = performance.now();
      const d = this.d, L = this.layout, pw = this.pw, ph = this.ph;
      const buf = this.buf, colS = this.colS, colRes = this.colRes, colSpan = this.colSpan;
      const top = this.sampleColumns();
      this.yMax = (this.fitY ? top : d.maxY) * 1.06 || 1;
      const sy = ph / this.yMax;
      buf.fill(BG32);
      const sp = this.spans;
      sp.n = 0;
      const next = L.next, HEAD = L.HEAD, alSize = d.alSize, colors = d.colors;
      let prevS = -3;
      for (let c = 0; c < pw; c++) {
        colSpan[c] = sp.n;
        const s = colS[c];
        if (s === -2) { prevS = -3; continue; }
        if (s === prevS && c > 0) {
          // Same event as the column before (zoomed in past one event per pixel): copy it.
          for (let i = ph - 1, p = c; i >= 0; i--, p += pw) buf[p] = buf[p - 1];
          const from = colSpan[c - 1], to = colSpan[c];
          this.reserveSpans(to - from);
          for (let i = from; i < to; i++) this.pushSpan(sp.a[i], sp.r0[i], sp.r1[i]);
          continue;
        }
        prevS = s;
        L.seek(s);
        let off = 0, broken = false;
        for (let a = next[HEAD]; a !== HEAD; a = next[a]) {
          const r0 = Math.ceil(off * sy - 0.5);
          if (r0 >= ph) { broken = true; break; }
          off += alSize[a];
          const r1 = Math.min(ph, Math.ceil(off * sy - 0.5));
          if (r1 > r0) {
            const col = colors[a];
            for (let r = r0, p = (ph - 1 - r0) * pw + c; r < r1; r++, p -= pw) buf[p] = col;
            this.pushSpan(a, r0, r1);
          }
        }
        if (broken) continue;
        const total = s >= 0 ? d.liveReq[s] : d.reqInit;
        let r0 = Math.ceil(off * sy - 0.5);
        let r1 = Math.min(ph, Math.ceil(total * sy - 0.5));
        if (r1 > r0) {
          for (let r = r0, p = (ph - 1 - r0) * pw + c; r < r1; r++, p -= pw) buf[p] = REST32;
          this.pushSpan(SPAN_REST, r0, r1);
        }
        r0 = Math.max(r1, r0);
        r1 = Math.min(ph, Math.ceil(colRes[c] * sy - 0.5));
        if (r1 > r0) {
          for (let r = r0, p = (ph - 1 - r0) * pw + c; r < r1; r++, p -= pw) buf[p] = CACHED32;
          this.pushSpan(SPAN_CACHED, r0, r1);
        }
      }
      colSpan[pw] = sp.n;
      this.ctx.fillStyle = '#ffffff';
      this.ctx.fillRect(0, 0, this.canvas.width, this.canvas.height);
      this.ctx.putImageData(this.image, this.pl, this.pt);
      this.dirty = false;
      this.overlayDirty = true;
      viz.renders++;
      viz.lastRenderMs = performance.now() - t0;
    }
    reserveSpans(n) {
      const sp = this.spans;
      if (sp.n + n <= sp.a.length) return;
      let cap = sp.a.length;
      while (cap < sp.n + n) cap *= 2;
      for (const k of ['a', 'r0', 'r1']) { const t = new Int32Array(cap); t.set(sp[k].subarray(0, sp.n)); sp[k] = t; }
    }
    pushSpan(a, r0, r1) {
      const sp = this.spans;
      if (sp.n === sp.a.length) this.reserveSpans(1);
      sp.a[sp.n] = a; sp.r0[sp.n] = r0; sp.r1[sp.n] = r1; sp.n++;
    }

    // What is under CSS point (x, y) of the chart.
    hit(x, y) {
      if (!this.image) return null;
      const c = Math.floor(x * this.dpr - this.pl);
      const row = this.ph - 1 - Math.floor(y * this.dpr - this.pt);
      if (c < 0 || c >= this.pw || row < 0 || row >= this.ph) return null;
      const s = this.colS[c];
      if (s === -2) return null;
      const sp = this.spans;
      for (let i = this.colSpan[c]; i < this.colSpan[c + 1]; i++) {
        if (sp.r0[i] <= row && row < sp.r1[i]) return { kind: sp.a[i] >= 0 ? 'alloc' : sp.a[i] === SPAN_REST ? 'rest' : 'cached', a: sp.a[i], s, c };
      }
      return { kind: 'empty', a: -1, s, c };
    }

    drawOverlay() {
      const ctx = this.octx, d = this.d, dpr = this.dpr;
      ctx.setTransform(1, 0, 0, 1, 0, 0);
      ctx.clearRect(0, 0, this.overlay.width, this.overlay.height);
      if (d.N === 0) return;
      const pl = this.pl, pt = this.pt, pw = this.pw, ph = this.ph;
      const yPix = (v) => pt + ph - v * (ph / this.yMax);
      ctx.font = Math.round(11 * dpr) + 'px system-ui, sans-serif';
      // Y axis: memory.
      ctx.strokeStyle = 'rgba(29,35,48,0.08)';
      ctx.fillStyle = '#6b7383';
      ctx.lineWidth = dpr;
      ctx.textAlign = 'right';
      ctx.textBaseline = 'middle';
      for (const v of byteTicks(this.yMax, Math.max(2, Math.floor(ph / (46 * dpr))))) {
        const y = Math.round(yPix(v)) + 0.5;
        ctx.beginPath(); ctx.moveTo(pl, y); ctx.lineTo(pl + pw, y); ctx.stroke();
        ctx.fillText(fmtTick(v), pl - 6 * dpr, y);
      }
      // X axis: events or time.
      ctx.textAlign = 'center';
      ctx.textBaseline = 'top';
      const [x0, x1] = this.view;
      const ticks = numberTicks(x0, x1, Math.max(2, Math.floor(pw / (110 * dpr))));
      const t0 = this.mode === 'time' ? d.evTime[0] : 0;
      for (const v of ticks) {
        const x = Math.round(this.xPix(v)) + 0.5;
        ctx.strokeStyle = 'rgba(29,35,48,0.25)';
        ctx.beginPath(); ctx.moveTo(x, pt + ph); ctx.lineTo(x, pt + ph + 4 * dpr); ctx.stroke();
        const label = this.mode === 'time' ? fmtDuration(v - t0) : fmtInt(v);
        const half = ctx.measureText(label).width / 2;
        ctx.fillText(label, Math.min(x, this.overlay.width - half - 2 * dpr), pt + ph + 7 * dpr);
      }
      ctx.textAlign = 'left';
      ctx.fillText(this.mode === 'time' ? 'time since the first event' : 'event', pl, pt + ph + 20 * dpr);
      ctx.strokeStyle = '#9aa3b2';
      ctx.strokeRect(pl - 0.5, pt - 0.5, pw + 1, ph + 1);

      // Reserved memory: a line over the columns' maxima.
      ctx.strokeStyle = RESERVED_COLOR;
      ctx.lineWidth = 1.5 * dpr;
      ctx.beginPath();
      let started = false;
      for (let c = 0; c < pw; c++) {
        if (this.colS[c] === -2) { started = false; continue; }
        const y = Math.max(pt, yPix(this.colRes[c]));
        if (!started) { ctx.moveTo(pl + c, y); started = true; } else ctx.lineTo(pl + c, y);
        ctx.lineTo(pl + c + 1, y);
      }
      ctx.stroke();

      // Annotations (external_annotations START marks) and OOMs.
      ctx.save();
      ctx.beginPath(); ctx.rect(pl, 0, pw, pt + ph); ctx.clip();
      const anns = d.meta.annotations || [];
      if (anns.length && d.hasTime) {
        ctx.fillStyle = '#6b7383';
        ctx.strokeStyle = 'rgba(107,115,131,0.45)';
        ctx.lineWidth = dpr;
        ctx.textBaseline = 'top';
        let lastX = -1e9;
        for (const an of anns) {
          if (an.stage !== 'START') continue;
          const t = an.time_us;
          const x = this.mode === 'time' ? this.xPix(t) : this.xPix(lowerBound(d.evTime, t));
          if (x < pl || x > pl + pw) continue;
          ctx.beginPath(); ctx.moveTo(x + 0.5, pt); ctx.lineTo(x + 0.5, pt + ph); ctx.stroke();
          // Labels only where they do not overlap the previous one.
          if (x > lastX) { ctx.fillText(an.name, x + 3 * dpr, 4 * dpr); lastX = x + ctx.measureText(an.name).width + 12 * dpr; }
        }
      }
      ctx.strokeStyle = OOM_COLOR;
      ctx.fillStyle = OOM_COLOR;
      ctx.lineWidth = 1.5 * dpr;
      ctx.setLineDash([4 * dpr, 3 * dpr]);
      ctx.textBaseline = 'top';
      ctx.font = 'bold ' + Math.round(11 * dpr) + 'px system-ui, sans-serif';
      let lastOom = -1e9;
      for (const o of d.ooms) {
        const x = Math.round(this.xPix(this.eventX(o.event))) + 0.5;
        if (x < pl || x > pl + pw) continue;
        ctx.beginPath(); ctx.moveTo(x, pt); ctx.lineTo(x, pt + ph); ctx.stroke();
        if (x - lastOom > 34 * dpr) { ctx.fillText('OOM', x + 3 * dpr, pt + 3 * dpr); lastOom = x; }
      }
      ctx.setLineDash([]);
      ctx.restore();

      // The event the allocator-state view shows.
      const sel = this.app.state ? this.app.state.sel : -1;
      if (sel >= 0 && this.app.state.state) {
        const x = Math.round(this.xPix(this.eventX(sel))) + 0.5;
        if (x >= pl && x <= pl + pw) {
          ctx.strokeStyle = '#2f6fdf';
          ctx.fillStyle = '#2f6fdf';
          ctx.lineWidth = dpr;
          ctx.beginPath(); ctx.moveTo(x, pt); ctx.lineTo(x, pt + ph); ctx.stroke();
          ctx.font = Math.round(10 * dpr) + 'px system-ui, sans-serif';
          ctx.textBaseline = 'bottom';
          ctx.fillText('state #' + fmtInt(sel), x + 3 * dpr, pt + ph - 2 * dpr);
        }
      }
      // Pinned and hovered allocations.
      if (this.hover && this.hover.kind === 'alloc' && this.hover.a !== this.pinned) this.outline(this.hover.a, 'rgba(20,24,33,0.28)', null);
      if (this.pinned >= 0) {
        this.outline(this.pinned, 'rgba(20,24,33,0.45)', '#111');
        this.lifetimeBracket(this.pinned);
      }
      // Cursor.
      if (this.mouse && this.hover) {
        const x = Math.round(this.mouse.x * dpr) + 0.5;
        ctx.strokeStyle = 'rgba(29,35,48,0.35)';
        ctx.lineWidth = dpr;
        ctx.beginPath(); ctx.moveTo(x, pt); ctx.lineTo(x, pt + ph); ctx.stroke();
      }
      this.overlayDirty = false;
    }
    // Darkens allocation a's spans in the current frame (consecutive columns merged).
    outline(a, fill, stroke) {
      const ctx = this.octx, sp = this.spans, pl = this.pl, pt = this.pt, ph = this.ph;
      ctx.fillStyle = fill;
      let runStart = -1, runR0 = 0, runR1 = 0;
      const flush = (end) => {
        if (runStart < 0) return;
        const x = pl + runStart, y = pt + ph - runR1, w = end - runStart, h = runR1 - runR0;
        ctx.fillRect(x, y, w, h);
        if (stroke) { ctx.strokeStyle = stroke; ctx.lineWidth = 1; ctx.strokeRect(x + 0.5, y + 0.5, Math.max(0, w - 1), Math.max(0, h - 1)); }
        runStart = -1;
      };
      for (let c = 0; c < this.pw; c++) {
        let found = -1;
        for (let i = this.colSpan[c]; i < this.colSpan[c + 1]; i++) if (sp.a[i] === a) { found = i; break; }
        if (found < 0) { flush(c); continue; }
        if (runStart >= 0 && sp.r0[found] === runR0 && sp.r1[found] === runR1) continue;
        flush(c);
        runStart = c; runR0 = sp.r0[found]; runR1 = sp.r1[found];
      }
      flush(this.pw);
    }
    // The pinned allocation's lifetime under the x axis (visible even when it is thinner
    // than a pixel at this zoom).
    lifetimeBracket(a) {
      const d = this.d, ctx = this.octx, dpr = this.dpr;
      const s = Math.max(0, d.alStart[a]), e = Math.min(d.N - 1, d.alEnd[a]);
      const xa = clamp(this.xPix(this.eventX(s)), this.pl, this.pl + this.pw);
      const xb = clamp(this.xPix(this.eventX(e)), this.pl, this.pl + this.pw);
      const y = this.pt + this.ph + 2 * dpr;
      ctx.fillStyle = '#111';
      ctx.fillRect(xa, y, Math.max(2 * dpr, xb - xa), 3 * dpr);
    }

    drawOverview() {
      const d = this.d, c = this.overviewCanvas, ctx = c.getContext('2d');
      const w = c.width, h = c.height;
      if (!w || !h || d.N === 0) return;
      const [D0, D1] = this.domain();
      if (!this.overviewCache || this.overviewCache.w !== w || this.overviewCache.mode !== this.mode) {
        // Per-column maxima of the whole trace, computed once per size and mode.
        const req = new Float64Array(w), res = new Float64Array(w);
        for (let e = 0; e < d.N; e++) {
          const x = this.mode === 'time' ? d.evTime[e] : e + 0.5;
          const col = clamp(Math.floor(((x - D0) / (D1 - D0)) * w), 0, w - 1);
          if (d.liveReq[e] > req[col]) req[col] = d.liveReq[e];
          if (d.reserved[e] > res[col]) res[col] = d.reserved[e];
        }
        for (let i = 1; i < w; i++) { if (req[i] === 0 && res[i] === 0) { req[i] = req[i - 1]; res[i] = res[i - 1]; } }
        this.overviewCache = { w, mode: this.mode, req, res };
      }
      const { req, res } = this.overviewCache;
      const sy = (h - 4) / d.maxY;
      ctx.fillStyle = '#ffffff';
      ctx.fillRect(0, 0, w, h);
      ctx.fillStyle = '#9fb4d3';
      for (let i = 0; i < w; i++) { const v = req[i] * sy; ctx.fillRect(i, h - v, 1, v); }
      ctx.strokeStyle = RESERVED_COLOR;
      ctx.lineWidth = this.dpr;
      ctx.beginPath();
      for (let i = 0; i < w; i++) { const y = h - res[i] * sy; if (i) ctx.lineTo(i, y); else ctx.moveTo(i, y); }
      ctx.stroke();
      ctx.fillStyle = OOM_COLOR;
      for (const o of d.ooms) {
        const x = ((this.eventX(o.event) - D0) / (D1 - D0)) * w;
        ctx.fillRect(Math.floor(x), 0, Math.max(1, this.dpr), h);
      }
      const a = ((this.view[0] - D0) / (D1 - D0)) * w, b = ((this.view[1] - D0) / (D1 - D0)) * w;
      ctx.fillStyle = 'rgba(47,111,223,0.14)';
      ctx.fillRect(a, 0, Math.max(2, b - a), h);
      ctx.strokeStyle = '#2f6fdf';
      ctx.lineWidth = 1.5 * this.dpr;
      ctx.strokeRect(a + 0.5, 1, Math.max(2, b - a) - 1, h - 2);
    }

    // The OOM whose line is within 4 px of CSS x, or -1.
    oomNear(x) {
      const dpr = this.dpr;
      return this.d.ooms.findIndex((o) => Math.abs(this.xPix(this.eventX(o.event)) - x * dpr) < 4 * dpr);
    }
    hoverHtml(h) {
      const d = this.d;
      const oom = this.mouse ? this.oomNear(this.mouse.x) : -1;
      if (oom >= 0) {
        const e = d.ooms[oom].event;
        return '<b>Out of memory</b> at event #' + fmtInt(e) + ': requested ' + fmtSize(d.evSize[e]) + ', the device had ' + fmtSize(d.evAddr[e]) +
          ' free.<div class="muted">Click for the explanation.</div>';
      }
      const at = '<div class="muted">After event #' + fmtInt(h.s) + (d.hasTime && h.s >= 0 ? ' (+' + fmtDuration(d.time(h.s)) + ')' : '') + '</div>';
      if (h.kind === 'alloc') return allocationHtml(d, h.a) + '<div class="muted">Click to pin.</div>';
      const live = h.s >= 0 ? d.liveReq[h.s] : d.reqInit;
      const reserved = h.s >= 0 ? d.reserved[h.s] : d.resInit;
      if (h.kind === 'rest') {
        const rest = h.s >= 0 ? this.layout.rest[h.s] : this.layout.restInit;
        return '<b>' + fmtSize(rest) + '</b> in allocations smaller than ' + fmtSize(this.layout.minSize) + ', summed' + at +
          '<div class="muted">Raise "Detail" to draw more of them individually.</div>';
      }
      const body = '<dl class="kv"><dt>Allocated (requested)</dt><dd>' + fmtSizeFull(live) + '</dd><dt>Reserved</dt><dd>' + fmtSizeFull(reserved) +
        '</dd><dt>Cached</dt><dd>' + fmtSizeFull(Math.max(0, reserved - live)) + '</dd></dl>';
      return (h.kind === 'cached' ? '<b>Cached</b>: reserved but not allocated' : '<b>' + esc(d.eventLine(h.s)) + '</b>') + body + at;
    }
    showDetails() {
      const el = $('tl-details'), d = this.d, a = this.pinned;
      if (a < 0) { el.innerHTML = '<p class="muted">Click an allocation to pin its details here.</p>'; return; }
      const start = d.alStart[a], end = d.alEnd[a];
      el.innerHTML = '<div class="actions">' +
        (start >= 0 ? '<button data-act="state-start">Allocator state at its alloc (#' + fmtInt(start) + ')</button>' : '') +
        (end < d.N ? '<button data-act="state-end">State just before its free (#' + fmtInt(end - 1) + ')</button>' : '') +
        '<button data-act="zoom">Zoom to its lifetime</button>' +
        '<button data-act="unpin">Unpin (Esc)</button></div>' + allocationHtml(d, a, { maxFrames: 60, full: true });
      el.querySelector('[data-act=zoom]').onclick = () => this.focusEvents(Math.max(0, start), Math.min(d.N - 1, end));
      el.querySelector('[data-act=unpin]').onclick = () => this.pin(-1);
      const s0 = el.querySelector('[data-act=state-start]');
      if (s0) s0.onclick = () => this.app.openState(start, a);
      const s1 = el.querySelector('[data-act=state-end]');
      if (s1) s1.onclick = () => this.app.openState(end - 1, a);
    }

    installInput() {
      const chart = this.chart;
      let drag = null;
      const local = (ev) => { const r = chart.getBoundingClientRect(); return { x: ev.clientX - r.left, y: ev.clientY - r.top }; };
      const updateHover = (ev) => {
        const p = local(ev);
        this.mouse = p;
        const h = this.hit(p.x, p.y);
        this.hover = h;
        if (h) tooltip.show(this.hoverHtml(h), ev.clientX, ev.clientY); else tooltip.hide();
        this.overlayDirty = true;  // the cursor line follows the pointer
        this.schedule();
      };
      chart.addEventListener('mousedown', (ev) => {
        if (ev.button !== 0) return;
        drag = { x: ev.clientX, view: this.view.slice(), moved: false };
        chart.focus({ preventScroll: true });
        ev.preventDefault();
      });
      window.addEventListener('mousemove', (ev) => {
        if (drag) {
          const dx = ev.clientX - drag.x;
          if (Math.abs(dx) > 3) drag.moved = true;
          if (drag.moved) {
            chart.classList.add('dragging');
            const span = drag.view[1] - drag.view[0];
            const shift = (-dx / (this.pw / this.dpr)) * span;
            this.view = [drag.view[0] + shift, drag.view[1] + shift];
            this.clampView();
            tooltip.hide();
            this.hover = null;
            this.invalidate();
          }
          return;
        }
        if (ev.target === chart || chart.contains(ev.target)) updateHover(ev);
      });
      window.addEventListener('mouseup', (ev) => {
        if (!drag) return;
        const wasDrag = drag.moved;
        drag = null;
        chart.classList.remove('dragging');
        if (wasDrag) return;
        const p = local(ev);
        const h = this.hit(p.x, p.y);
        if (!h) return;
        const oom = this.oomNear(p.x);
        if (oom >= 0) this.app.openOom(oom);  // a click on an OOM line opens its explanation
        else this.pin(h.kind === 'alloc' ? h.a : -1);
      });
      chart.addEventListener('mouseleave', () => {
        this.mouse = null; this.hover = null; tooltip.hide(); this.overlayDirty = true; this.schedule();
      });
      chart.addEventListener('wheel', (ev) => {
        ev.preventDefault();
        const p = local(ev);
        const span = this.view[1] - this.view[0];
        if (ev.shiftKey || Math.abs(ev.deltaX) > Math.abs(ev.deltaY)) {
          const delta = ev.shiftKey ? ev.deltaY : ev.deltaX;
          const shift = (delta / (this.pw / this.dpr)) * span;
          this.view = [this.view[0] + shift, this.view[1] + shift];
        } else {
          const f = Math.exp(clamp(ev.deltaY, -300, 300) * 0.0018);
          const fx = clamp((p.x * this.dpr - this.pl) / this.pw, 0, 1);
          const at = this.view[0] + fx * span;
          this.view = [at - fx * span * f, at + (1 - fx) * span * f];
        }
        this.clampView();
        this.invalidate();
        updateHover(ev);
      }, { passive: false });
      chart.addEventListener('dblclick', (ev) => {
        const p = local(ev);
        const span = this.view[1] - this.view[0];
        const fx = clamp((p.x * this.dpr - this.pl) / this.pw, 0, 1);
        const at = this.view[0] + fx * span;
        this.view = [at - fx * span / 2, at + (1 - fx) * span / 2];
        this.clampView();
        this.invalidate();
      });
      chart.addEventListener('keydown', (ev) => {
        const span = this.view[1] - this.view[0];
        const mid = (this.view[0] + this.view[1]) / 2;
        let handled = true;
        if (ev.key === 'ArrowLeft') this.view = [this.view[0] - span * 0.15, this.view[1] - span * 0.15];
        else if (ev.key === 'ArrowRight') this.view = [this.view[0] + span * 0.15, this.view[1] + span * 0.15];
        else if (ev.key === '+' || ev.key === '=') this.view = [mid - span / 3, mid + span / 3];
        else if (ev.key === '-' || ev.key === '_') this.view = [mid - span * 0.75, mid + span * 0.75];
        else if (ev.key === '0' || ev.key === 'Home') this.view = this.domain();
        else handled = false;
        if (handled) { ev.preventDefault(); this.clampView(); this.invalidate(); }
      });
      // Overview: click to centre, drag to move the window.
      const ov = this.overviewCanvas;
      let ovDrag = null;
      const ovX = (ev) => { const r = ov.getBoundingClientRect(); const [D0, D1] = this.domain(); return D0 + ((ev.clientX - r.left) / r.width) * (D1 - D0); };
      ov.addEventListener('mousedown', (ev) => {
        const x = ovX(ev);
        const span = this.view[1] - this.view[0];
        if (x < this.view[0] || x > this.view[1]) { this.view = [x - span / 2, x + span / 2]; this.clampView(); this.invalidate(); }
        ovDrag = { x, view: this.view.slice() };
        ev.preventDefault();
      });
      window.addEventListener('mousemove', (ev) => {
        if (!ovDrag) return;
        const shift = ovX(ev) - ovDrag.x;
        this.view = [ovDrag.view[0] + shift, ovDrag.view[1] + shift];
        this.clampView();
        this.invalidate();
      });
      window.addEventListener('mouseup', () => { ovDrag = null; });
    }

    // For tests and scripting: a point on the band of a large allocation (CSS px, client
    // coordinates), preferring ones with a recorded stack.
    bandPoint({ withStack = false } = {}) {
      const sp = this.spans, r = this.chart.getBoundingClientRect();
      let best = -1, bestH = 0;
      for (let i = 0; i < sp.n; i++) {
        const a = sp.a[i];
        if (a < 0) continue;
        if (withStack && this.d.alStack[a] < 0) continue;
        const h = sp.r1[i] - sp.r0[i];
        if (h > bestH) { bestH = h; best = i; }
      }
      if (best < 0) return null;
      const c = lowerBound(this.colSpan, best + 1) - 1;
      const row = (sp.r0[best] + sp.r1[best]) / 2;
      return {
        alloc: sp.a[best],
        x: r.left + (this.pl + c + 0.5) / this.dpr,
        y: r.top + (this.pt + this.ph - 1 - row) / this.dpr,
      };
    }
  }

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

  // ---------------------------------------------------------------------------------------
  // OOM explainer

  class OomView {
    constructor(app) {
      this.app = app;
      this.d = app.data;
      this.index = 0;
      this.page = $('oom-page');
      const badge = $('oom-badge');
      badge.textContent = this.d.ooms.length ? fmtInt(this.d.ooms.length) : '';
      badge.classList.toggle('hot', this.d.ooms.length > 0);
    }
    show(i = this.index) {
      const d = this.d;
      if (d.ooms.length === 0) {
        this.page.innerHTML = '<div class="card"><h2>No out-of-memory error in this trace</h2>' +
          '<p>When an allocation fails, its <code>oom</code> entry appears here with the reason and the config that would have avoided it.</p>' +
          '<p class="muted">To see where a trace would run out of memory on a smaller GPU: <code>ccalloc viz TRACE.csv.gz --capacity 10GiB -o out.html</code>.</p></div>';
        return;
      }
      this.index = i = clamp(i, 0, d.ooms.length - 1);
      const o = d.ooms[i], e = o.event;
      const st = stateAt(d, e);
      const f = this.facts(o, st);
      const nav = '<div class="oom-nav"><button data-act="prev" ' + (i === 0 ? 'disabled' : '') + '>&larr; Previous</button>' +
        '<b>OOM ' + fmtInt(i + 1) + ' of ' + fmtInt(d.ooms.length) + '</b> <span class="muted">at event #' + fmtInt(e) + (d.hasTime ? ' (+' + fmtDuration(d.time(e)) + ')' : '') + '</span>' +
        '<button data-act="next" ' + (i === d.ooms.length - 1 ? 'disabled' : '') + '>Next &rarr;</button>' +
        '<span class="spacer"></span><button data-act="state">Open the allocator state at this OOM</button><button data-act="timeline">Show on the timeline</button></div>';
      const verdict = this.verdict(f);
      const whatIf = this.whatIf(f);
      const max = Math.max(f.rounded, f.largestSame, f.free, f.deviceFree, f.segmentSize, 1);
      const bar = (label, v, color, note) => '<div>' + label + '</div><div><div class="bar" style="width:' + ((100 * v) / max).toFixed(2) + '%;background:' + color + '"></div></div><div class="mono">' + fmtSize(v) + (note ? ' <span class="muted">' + note + '</span>' : '') + '</div>';
      const bars = '<div class="bars">' +
        bar('Request (rounded)', f.rounded, OOM_COLOR) +
        bar('Largest free block it could use', f.largestSame, LARGEST_COLOR, f.small ? 'small pool' : 'large pool') +
        (f.largestAny > f.largestSame ? bar('Largest free block anywhere', f.largestAny, '#8cc9a6') : '') +
        bar('All free (cached) bytes', f.free, '#b8c7de') +
        bar('Free on the device', f.deviceFree, '#d5dae3', 'room for a new segment: ' + fmtSize(f.segmentSize) + ' needed') + '</div>';
      const stranded = st.segments.filter((g) => g.free > 0).sort((a, b) => b.free - a.free);
      const rows = stranded.slice(0, 15).map((g, k) => '<tr class="click" data-seg="' + k + '"><td class="mono">' + hex(g.addr) + '</td><td>' + (g.expandable ? 'expandable' : g.small ? 'small' : 'large') +
        (d.meta.streams.length > 1 ? ' / s' + esc(d.streamName(g.stream)) : '') + '</td><td class="num">' + fmtSize(g.size) + '</td><td class="num">' + fmtSize(g.allocated + g.pending) + '</td><td class="num"><b>' + fmtSize(g.free) +
        '</b></td><td class="num">' + fmtSize(g.largest) + '</td><td class="num">' + pct(g.frag) + '</td><td><canvas width="240" height="12" data-bar="' + k + '"></canvas></td></tr>').join('');
      const restFree = stranded.slice(15).reduce((s, g) => s + g.free, 0);
      this.page.innerHTML = nav +
        '<div class="card"><h2>Tried to allocate ' + fmtSize(f.rounded) + ' on stream ' + esc(d.streamName(f.stream)) + '</h2>' +
        '<p>A new segment would have taken <b>' + fmtSize(f.segmentSize) + '</b>; the device had <b>' + fmtSize(f.deviceFree) + '</b> free' +
        (d.meta.capacity ? ' of ' + fmtSize(d.meta.capacity) : '') + '. The allocator held <b>' + fmtSize(f.reserved) + '</b> in ' + fmtInt(st.segments.length) +
        ' segments: ' + fmtSize(f.allocated) + ' allocated' + (f.pending ? ', ' + fmtSize(f.pending) + ' pending free' : '') + ' and <b>' + fmtSize(f.free) + ' free but cached</b>.</p>' +
        bars + '</div>' + verdict + whatIf +
        '<div class="card"><h2>Where the free bytes are stranded</h2>' +
        (stranded.length ? '<p class="muted">Segments with free space at the OOM, most free first. Click a row to open it in the allocator state.</p>' +
          '<table class="grid"><tr><th>Segment</th><th>Pool</th><th class="num">Size</th><th class="num">In use</th><th class="num">Free</th><th class="num">Largest free</th><th class="num">Fragmentation</th><th>Blocks</th></tr>' + rows + '</table>' +
          (stranded.length > 15 ? '<p class="muted">and ' + fmtInt(stranded.length - 15) + ' more segments with ' + fmtSize(restFree) + ' free.</p>' : '')
          : '<p>No segment had free space: every reserved byte was in use.</p>') + '</div>';
      for (const cv of this.page.querySelectorAll('canvas[data-bar]')) {
        const g = stranded[+cv.dataset.bar];
        this.app.state.drawBar(cv.getContext('2d'), g, 0, 0, cv.width, cv.height);
      }
      for (const tr of this.page.querySelectorAll('tr[data-seg]')) {
        tr.onclick = () => {
          const g = stranded[+tr.dataset.seg];
          this.app.openState(e, -1);
          const sv = this.app.state;
          const r = sv.orderIdx.findIndex((k) => sv.state.segments[k].addr === g.addr);
          if (r >= 0) { sv.scroll.scrollTop = Math.max(0, r * SEG_ROW_H - 40); sv.drawSegments(); }
        };
      }
      const on = (act, fn) => { const x = this.page.querySelector('[data-act=' + act + ']'); if (x) x.onclick = fn; };
      on('prev', () => this.show(i - 1));
      on('next', () => this.show(i + 1));
      on('state', () => this.app.openState(e, -1));
      on('timeline', () => { this.app.showTab('timeline'); this.app.timeline.focusEvents(Math.max(0, e - 200), Math.min(d.N - 1, e + 200)); });
    }
    // The numbers ccalloc's OOM message is made of, from the state at the OOM.
    facts(o, st) {
      const d = this.d, e = o.event, stream = d.evStream[e];
      const f = { rounded: o.rounded || d.evSize[e], segmentSize: o.segment_size || d.evSize[e], small: !!o.small, stream, deviceFree: d.evAddr[e],
        reserved: st.totals.reserved, allocated: st.totals.allocated, pending: st.totals.pending, free: st.totals.free,
        largestSame: 0, largestAny: 0, freeOtherStreams: 0 };
      for (const g of st.segments) {
        f.largestAny = Math.max(f.largestAny, g.largest);
        if (g.stream === stream && g.small === f.small) f.largestSame = Math.max(f.largestSame, g.largest);
        if (g.stream !== stream) f.freeOtherStreams += g.free;
      }
      f.unallocated = f.reserved - f.allocated - f.pending;
      f.capacity = d.meta.capacity || f.reserved + f.deviceFree;
      return f;
    }
    // The reason and the advice: the branches of oom_message() in src/core/oom_ladder.cpp,
    // except that "fragmented" is judged on all free memory, cached and on the device: when
    // their sum covers the request, it failed for want of one piece, not of bytes.
    verdict(f) {
      let title, body, config = '';
      const freeAnywhere = Math.max(0, f.unallocated) + f.deviceFree;
      if (f.deviceFree >= f.segmentSize) {
        title = 'A memory limit refused it, not the device';
        body = 'The device still had ' + fmtSize(f.deviceFree) + ' free, enough for the ' + fmtSize(f.segmentSize) +
          ' segment: the per-process memory fraction (or another cap on reserved memory) stopped the allocator. Raise it to let the request succeed.';
        config = 'per_process_memory_fraction (torch.cuda.set_per_process_memory_fraction): raise it';
      } else if (freeAnywhere >= f.rounded && f.unallocated >= f.rounded && f.freeOtherStreams >= f.rounded) {
        title = 'Enough memory was cached, on other streams';
        body = fmtSize(f.freeOtherStreams) + ' was free in segments of other streams, but free blocks stay with the stream that allocated them.';
        config = 'allocate on fewer streams, or call torch.cuda.empty_cache() after the other streams\u2019 work';
      } else if (freeAnywhere >= f.rounded && !this.d.expandable) {
        title = 'Fragmentation: enough memory was free, but not in one piece';
        body = fmtSize(freeAnywhere) + ' was free (' + fmtSize(Math.max(0, f.unallocated)) + ' cached in the allocator\u2019s segments, ' + fmtSize(f.deviceFree) +
          ' on the device), more than the ' + fmtSize(f.rounded) + ' requested, yet the largest free block it could use was ' + fmtSize(f.largestSame) +
          ' and a new segment needed ' + fmtSize(f.segmentSize) + '. The cached bytes are stranded between live blocks in the segments below.';
        config = 'PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  (or max_split_size_mb to keep large blocks whole)';
      } else if (freeAnywhere >= f.rounded) {
        title = 'Free memory is pinned by live blocks';
        body = fmtSize(freeAnywhere) + ' was free in all, but the cached part lies in partly used pages of the expandable segments: freeing long-lived allocations sooner would help.';
      } else {
        title = 'The live allocations alone need more memory than the device has';
        body = 'Only ' + fmtSize(freeAnywhere) + ' was free anywhere (cached and on the device): no allocator policy could have served ' + fmtSize(f.rounded) +
          ' here; it is ' + fmtSize(f.rounded - freeAnywhere) + ' short.';
        config = 'reduce the working set (smaller batch, activation checkpointing) or use a device with more memory';
      }
      return '<div class="card verdict"><h2>' + esc(title) + '</h2><p>' + esc(body) + '</p>' +
        (config ? '<div>Suggested: <span class="suggest">' + esc(config) + '</span></div>' : '') + '</div>';
    }
    whatIf(f) {
      const w = this.d.meta.what_if;
      if (!w || !w.runs || w.runs.length === 0) return '';
      const limited = w.runs.filter((r) => !r.unlimited);
      const unlimited = w.runs.filter((r) => r.unlimited);
      const avoid = limited.filter((r) => !r.error && r.ooms === 0);
      let lead;
      if (avoid.length) {
        lead = '<p><b>Verified by replay:</b> with <span class="suggest">' + esc(avoid[0].label) + '</span> this trace runs without OOM on ' + fmtSize(w.capacity) +
          ' (peak reserved ' + fmtSize(avoid[0].peak_reserved) + ').</p>';
      } else {
        lead = '<p><b>No config tried avoids it on ' + fmtSize(w.capacity) + '.</b> The live requested bytes alone peak at ' + fmtSize(w.peak_requested) + '.</p>';
      }
      const row = (r) => {
        const need = unlimited.find((u) => u.label === r.label);
        const cls = r.error ? '' : r.ooms === 0 ? 'good' : 'bad';
        return '<tr class="' + cls + '"><td>' + esc(r.label) + '</td><td class="mono">' + esc(r.conf) + '</td><td class="num">' + (r.error ? '<span title="' + esc(r.error) + '">replay failed</span>' : fmtInt(r.ooms)) +
          '</td><td class="num">' + (r.error ? '-' : fmtSize(r.peak_reserved)) + '</td><td class="num">' + (need && !need.error ? fmtSize(need.peak_reserved) : '-') + '</td></tr>';
      };
      return '<div class="card ' + (avoid.length ? 'verdict ok' : '') + '"><h2>Would another config have avoided it?</h2>' + lead +
        '<table class="grid"><tr><th>Config</th><th>Replayed as</th><th class="num">OOMs on ' + fmtSize(w.capacity) + '</th><th class="num">Peak reserved</th><th class="num">Memory it needs</th></tr>' +
        limited.map(row).join('') + '</table>' +
        '<p class="muted">The trace replayed on a simulated GPU of ' + fmtSize(w.capacity) + ' (' + esc(w.capacity_source) + '); each failed request is retried as an allocation freed at once. ' +
        '"Memory it needs": peak reserved with unlimited memory. Floor: ' + fmtSize(w.peak_requested) + ' of live requested bytes.</p></div>';
    }
  }

  // ---------------------------------------------------------------------------------------
  // Summary

  function renderSummary(app) {
    const d = app.data, m = d.meta, s = m.stats || {};
    const final = stateAt(d, d.N - 1);
    const jump = (e, text) => '<a class="jump" data-event="' + e + '">' + text + '</a>';
    const kinds = new Array(EVENT_NAMES.length).fill(0);
    for (let e = 0; e < d.N; e++) kinds[d.evKind[e]]++;
    const counts = EVENT_NAMES.map((n, k) => [n, kinds[k]]).filter(([, c]) => c > 0).map(([n, c]) => n + ' ' + fmtInt(c)).join(', ');
    const row = (k, v) => '<tr><th>' + k + '</th><td>' + v + '</td></tr>';
    const stat = (key) => (s[key] !== undefined ? fmtSizeFull(s[key]) : '-');
    const html = [];
    html.push('<div class="card"><h2>Trace</h2><table class="grid wrap">' +
      row('File', esc(m.title)) + row('Source', esc(m.source)) + row('Config', '<code>' + esc(m.conf) + '</code>') +
      row('Device', m.device + (m.capacity ? ' (' + fmtSize(m.capacity) + ')' : '')) +
      row('Events', fmtInt(d.N) + ' from ' + fmtInt(m.counts.trace_entries) + ' trace entries (adjacent free_requested + free_completed shown as one free): ' + esc(counts)) +
      row('Allocations', fmtInt(d.A)) + row('Streams', esc(m.streams.join(', ') || '-')) +
      (d.hasTime ? row('Duration', fmtDuration(d.evTime[d.N - 1] - d.evTime[0])) : '') +
      row('At the end', fmtInt(final.totals.segments) + ' segments, ' + fmtSize(final.totals.reserved) + ' reserved, ' + fmtSize(final.totals.allocated) + ' allocated') +
      '</table></div>');
    html.push('<div class="card"><h2>Peaks</h2><table class="grid"><tr><th></th><th class="num">Bytes</th><th>When</th></tr>' +
      '<tr><td>Live requested bytes (the floor no allocator can go below)</td><td class="num">' + fmtSizeFull(d.peakReq.bytes) + '</td><td>' + (d.peakReq.event >= 0 ? jump(d.peakReq.event, 'event #' + fmtInt(d.peakReq.event)) : '-') + '</td></tr>' +
      '<tr><td>Reserved (from the trace\u2019s segment events)</td><td class="num">' + fmtSizeFull(d.peakRes.bytes) + '</td><td>' + (d.peakRes.event >= 0 ? jump(d.peakRes.event, 'event #' + fmtInt(d.peakRes.event)) : '-') + '</td></tr>' +
      '<tr><td>allocated_bytes.all.peak</td><td class="num">' + stat('allocated_bytes.all.peak') + '</td><td class="muted">memory_stats()</td></tr>' +
      '<tr><td>reserved_bytes.all.peak</td><td class="num">' + stat('reserved_bytes.all.peak') + '</td><td class="muted">memory_stats()</td></tr>' +
      '<tr><td>requested_bytes.all.peak</td><td class="num">' + stat('requested_bytes.all.peak') + '</td><td class="muted">memory_stats()</td></tr>' +
      '<tr><td>Reserved / live requested at their peaks</td><td class="num">' + (d.peakReq.bytes > 0 ? (d.peakRes.bytes / d.peakReq.bytes).toFixed(3) : '-') + '</td><td class="muted">1.000 = no overhead</td></tr>' +
      '<tr><td>Device allocations / frees, retries, OOMs</td><td class="num">' + ['num_device_alloc', 'num_device_free', 'num_alloc_retries', 'num_ooms'].map((k) => fmtInt(s[k] || 0)).join(' / ') + '</td><td class="muted">memory_stats()</td></tr>' +
      '</table></div>');
    html.push('<div class="card"><h2>memory_summary()</h2><pre class="summary">' + esc(m.summary.text) + '</pre><p class="muted">' +
      (m.summary.method === 'replay' ? 'Statistics reproduced by replaying the trace (exact, peaks and totals included).' : 'Statistics from the segments\u2019 final state: peaks and totals need a trace that covers the whole run.') + '</p></div>');
    if (m.warnings && m.warnings.length) html.push('<div class="card"><h2>Inconsistencies in the trace</h2>' + m.warnings.map((w) => '<div class="warn">' + esc(w) + '</div>').join('') + '</div>');
    html.push('<div class="card"><h2>Allocator settings</h2><pre class="summary">' + esc(JSON.stringify(m.settings, null, 2)) + '</pre></div>');
    if (m.annotations && m.annotations.length) {
      html.push('<div class="card"><h2>Annotations</h2><table class="grid"><tr><th>Name</th><th>Stage</th><th>Time</th></tr>' +
        m.annotations.slice(0, 500).map((a) => '<tr><td>' + esc(a.name) + '</td><td>' + esc(a.stage) + '</td><td>+' + fmtDuration(a.time_us) + '</td></tr>').join('') + '</table></div>');
    }
    const page = $('summary-page');
    page.innerHTML = html.join('');
    for (const a of page.querySelectorAll('a.jump')) {
      a.onclick = () => { const e = +a.dataset.event; app.showTab('timeline'); app.timeline.focusEvents(Math.max(0, e - 500), Math.min(d.N - 1, e + 500)); };
    }
  }

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
      const tabs = { 1: 'timeline', 2: 'state', 3: 'oom', 4: 'summary' };
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
})();
