// The payload: decoding the page's columns, and Data, which every view reads (columns
// plus what is derived from them once at load), and stack frame rendering.

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
    // Stitching policy only: per page of its address ranges (viz/page.cpp physical_json).
    this.pieceCols = c.pg_state ? { state: c.pg_state, free: c.pg_free, handle: c.pg_handle, lent: c.pg_lent, piece: c.pg_piece } : null;

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
