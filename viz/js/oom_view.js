// OomView: for each OOM, the request against the largest free block, the stranded free
// bytes, the reason and the what-if replays.

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
  // The reason and the advice: the branches of oom_message() in src/native/oom_ladder.cpp,
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
