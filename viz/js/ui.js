// What several views share on screen: axis ticks, the tooltip, and the description of
// one allocation.

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
