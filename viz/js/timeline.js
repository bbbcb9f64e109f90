// Timeline: the active memory timeline view (pan, zoom, bands, overview, pinned
// allocation).

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
