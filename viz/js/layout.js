// Layout: which allocations the timeline draws as their own band, and the live list of
// those, advanced event by event from checkpoints.

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
