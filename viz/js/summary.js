// The summary tab: memory_summary(), peaks and settings.

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
