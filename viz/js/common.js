// The viewer's shared ground: the hooks the browser tests read (window.__viz), the
// constants shared with viz/model.hpp, and the formatting and search helpers every view
// uses.

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
