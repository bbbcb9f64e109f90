// Browser tests of ccalloc's memory viewer, in Debian's headless Chromium driven by
// playwright-core. Run by scripts/test-viz (which builds ccalloc and installs what is
// missing):
//
//   node tests/viz/viewer_test.js --ccalloc build/plain/bin/ccalloc --traces data/traces \
//        --out build/viz-artifacts --work build/viz-work
//
// For every trace file: `ccalloc viz` writes the page; the page loads with no console error,
// page error or request other than its own file; the timeline draws; hovering a band shows
// the allocation (and, for .frames traces, a frame of its recorded stack); the allocator
// state has the segment count `ccalloc summary` prints after the last event, and the count
// the trace implies after an event found by searching an address; the event list follows
// the arrow keys. Then: the first frame of gpt2_train_varlen.pickle.gz within 3 s, an OOM
// page (gpt2 replayed on 10.2 GiB) explained and verified, the stitching policy's pieces
// tab (moe replayed under it) against `ccalloc summary`, and a synthetic trace of 1.2
// million entries (gpt2 seven times over) loading and panning. Screenshots and
// results.json go to --out.
'use strict';
const { execFileSync } = require('child_process');
const fs = require('fs');
const path = require('path');
const zlib = require('zlib');
const { chromium } = require('playwright-core');

const CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];
const FIRST_FRAME_BUDGET_MS = 3000;  // the bar, for gpt2_train_varlen.pickle.gz
const BIG_FIRST_FRAME_BUDGET_MS = 15000;
const BIG_PAN_FRAME_BUDGET_MS = 250;  // "pans without freezing" on a 2-core CI machine

function parseArgs() {
  const args = { ccalloc: 'build/plain/bin/ccalloc', traces: process.env.CCALLOC_TRACES_DIR || 'data/traces',
    out: 'build/viz-artifacts', work: 'build/viz-work', only: null, big: true, sample: false };
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i++) {
    const k = argv[i].replace(/^--/, '');
    if (k === 'no-big') args.big = false;
    else if (k === 'sample') args.sample = true;
    else args[k] = argv[++i];
  }
  for (const k of ['ccalloc', 'traces', 'out', 'work']) args[k] = path.resolve(args[k]);
  return args;
}

const args = parseArgs();
fs.mkdirSync(args.out, { recursive: true });
fs.mkdirSync(args.work, { recursive: true });
const failures = [];
const results = { pages: [], big: null, oom: null };

function check(ok, what) {
  if (!ok) { failures.push(what); console.log('  FAIL ' + what); }
  return ok;
}
function ccalloc(...a) {
  return execFileSync(args.ccalloc, a, { encoding: 'utf8', maxBuffer: 1 << 28 });
}
function timed(fn) { const t = Date.now(); const r = fn(); return [r, Date.now() - t]; }

// ---- the trace a page shows, as rows, and the segments it holds after a row

function readCsv(file) {
  let text = fs.readFileSync(file);
  if (text[0] === 0x1f && text[1] === 0x8b) text = zlib.gunzipSync(text);
  const lines = text.toString('utf8').trim().split('\n');
  const header = lines[0].split(',');
  const col = (n) => header.indexOf(n);
  const [ia, ip, is, ist] = [col('action'), col('addr'), col('size'), col('stream')];
  return lines.slice(1).map((l) => {
    const f = l.split(',');
    return { action: f[ia], addr: BigInt(f[ip]), size: BigInt(f[is]), stream: ist >= 0 ? f[ist] : '0' };
  });
}
// Segments held after row `upto`: cudaMalloc'd ranges, and runs of mapped pages of one stream.
function segmentsAfterRow(rows, upto) {
  let held = [];  // {lo, hi, stream, exp}
  for (let i = 0; i <= upto; i++) {
    const r = rows[i];
    const lo = r.addr, hi = r.addr + r.size;
    if (r.action === 'segment_alloc' || r.action === 'segment_map') {
      held.push({ lo, hi, stream: r.stream, exp: r.action === 'segment_map' });
    } else if (r.action === 'segment_free') {
      held = held.filter((h) => h.lo !== lo);
    } else if (r.action === 'segment_unmap') {
      const next = [];
      for (const h of held) {
        if (h.hi <= lo || h.lo >= hi) { next.push(h); continue; }
        if (h.lo < lo) next.push({ ...h, hi: lo });
        if (h.hi > hi) next.push({ ...h, lo: hi });
      }
      held = next;
    }
  }
  held.sort((a, b) => (a.lo < b.lo ? -1 : a.lo > b.lo ? 1 : 0));
  let count = 0, last = null;
  for (const h of held) {
    if (last && h.exp && last.exp && last.stream === h.stream && last.hi === h.lo) { last.hi = h.hi; continue; }
    count++;
    last = { ...h };
  }
  return count;
}
function segmentsFromSummary(text) {
  const m = /^segments: (\d+)$/m.exec(text);
  if (!m) throw new Error('ccalloc summary printed no "segments: N" line');
  return +m[1];
}

// ---- one browser page

async function openPage(browser, file) {
  const context = await browser.newContext({ viewport: { width: 1440, height: 900 } });
  const page = await context.newPage();
  const url = 'file://' + file;
  const problems = [];
  page.on('console', (m) => { if (m.type() === 'error') problems.push('console error: ' + m.text()); });
  page.on('pageerror', (e) => problems.push('page error: ' + e.message));
  page.on('request', (r) => { if (r.url() !== url) problems.push('request: ' + r.url()); });
  const t = Date.now();
  await page.goto(url);
  await page.waitForFunction(() => window.__viz && (window.__viz.ready || window.__viz.error), null, { timeout: 60000 });
  const wallMs = Date.now() - t;
  const info = await page.evaluate(() => ({ firstFrameMs: window.__viz.firstFrameMs, loadMs: window.__viz.loadMs, error: window.__viz.error,
    renderMs: window.__viz.lastRenderMs, data: window.__viz.data, conf: window.__viz.app && window.__viz.app.data.meta.conf }));
  return { context, page, problems, info, wallMs };
}
const nextFrame = (page) => page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));

// Fraction of the timeline's plot pixels that are not background.
function inkFraction(page) {
  return page.evaluate(() => {
    const c = document.getElementById('tl-canvas');
    const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let ink = 0;
    for (let i = 0; i < data.length; i += 4) if (data[i] < 250 || data[i + 1] < 250 || data[i + 2] < 250) ink++;
    return ink / (c.width * c.height);
  });
}

async function testTrace(browser, file) {
  const name = path.basename(file);
  const stem = name.replace(/\.(pickle|json|csv)(\.gz)?$/, '').replace(/\.gz$/, '');
  const shot = name.replace(/\.gz$/, '');  // screenshots of X.csv.gz and X.pickle.gz differ
  const isCsv = /\.csv(\.gz)?$/.test(name);
  console.log('== ' + name);
  const r = { file: name };
  const html = path.join(args.work, name + '.html');
  [, r.vizMs] = timed(() => ccalloc('viz', file, '-o', html));
  r.pageBytes = fs.statSync(html).size;

  const { context, page, problems, info, wallMs } = await openPage(browser, html);
  r.firstFrameMs = Math.round(info.firstFrameMs);
  r.loadWallMs = wallMs;
  check(!info.error, name + ': the page loaded (' + info.error + ')');

  // The trace the page shows and the segments it holds at the end, from ccalloc itself.
  const traceCsv = path.join(args.work, stem + (isCsv ? '.replayed' : '') + '.trace.csv');
  let summary;
  if (isCsv) {
    const snap = path.join(args.work, stem + '.replayed.pickle.gz');
    ccalloc('replay', file, '--conf', info.conf, '--address-oracle', '--emit-trace', traceCsv, '--snapshot-out', snap);
    summary = ccalloc('summary', snap);
  } else {
    ccalloc('convert', file, traceCsv);
    summary = ccalloc('summary', file);
  }
  const rows = readCsv(traceCsv);
  r.expectedSegments = segmentsFromSummary(summary);

  // Timeline: drawn.
  r.ink = await inkFraction(page);
  check(r.ink > 0.01, name + ': the timeline has a drawing (' + (100 * r.ink).toFixed(2) + '% of pixels)');

  // Hover: the allocation under the pointer, with its stack for .frames traces.
  const withStack = name.includes('.frames.');
  const pt = await page.evaluate((ws) => window.__viz.bandPoint({ withStack: ws }), withStack);
  if (check(pt, name + ': a band to hover')) {
    await page.mouse.move(pt.x, pt.y);
    await nextFrame(page);
    const tip = await page.evaluate(() => { const t = document.getElementById('tooltip'); return t.hidden ? '' : t.innerText; });
    const addr = await page.evaluate((a) => '0x' + window.__viz.app.data.alAddr[a].toString(16), pt.alloc);
    check(tip.includes('allocation') && tip.includes(addr), name + ': hovering shows the allocation at ' + addr);
    if (withStack) {
      // The stack of that allocation's alloc entry, read from the snapshot by ccalloc.
      const json = path.join(args.work, stem + '.expected.json');
      ccalloc('convert', file, json);
      const snap = JSON.parse(fs.readFileSync(json, 'utf8'));
      const entry = await page.evaluate((a) => { const d = window.__viz.app.data; return d.evEntry[d.alStart[a]]; }, pt.alloc);
      const frames = snap.device_traces[0][entry].frames || [];
      const shown = frames.filter((f) => tip.includes(f.name) && tip.includes(f.filename + ':' + f.line));
      r.hoverFrame = shown.length ? shown[0].name + ' ' + shown[0].filename + ':' + shown[0].line : null;
      check(shown.length > 0, name + ': the tooltip shows a frame of trace entry ' + entry + '\'s stack');
    }
  }
  await page.screenshot({ path: path.join(args.out, shot + '-timeline.png') });

  // Allocator state: the final event, then an event found by address, then the arrow keys.
  await page.keyboard.press('2');
  await page.locator('#ev-list').focus();
  await page.keyboard.press('End');
  await nextFrame(page);
  let header = await page.evaluate(() => ({ ...document.getElementById('st-header').dataset }));
  r.finalSegments = +header.segments;
  check(+header.event === info.data.events - 1, name + ': End selects the last event');
  check(r.finalSegments === r.expectedSegments, name + ': ' + r.finalSegments + ' segments after the last event, ccalloc summary says ' + r.expectedSegments);

  const segmentRows = rows.map((x, i) => [x, i]).filter(([x]) => x.action === 'segment_alloc' || x.action === 'segment_map');
  const [seg] = segmentRows[Math.floor(segmentRows.length / 2)];
  const q = seg.addr + 4096n;
  const first = rows.findIndex((x) => x.action !== 'oom' && x.action !== 'snapshot' && x.addr <= q && q < x.addr + (x.size > 0n ? x.size : 1n));
  await page.fill('#ev-search', '0x' + q.toString(16));
  await page.press('#ev-search', 'Enter');
  await nextFrame(page);
  header = await page.evaluate(() => ({ ...document.getElementById('st-header').dataset }));
  const entry = await page.evaluate((e) => window.__viz.app.data.evEntry[e], +header.event);
  r.searchEvent = +header.event;
  r.searchSegments = +header.segments;
  r.searchExpected = segmentsAfterRow(rows, first);
  check(entry === first, name + ': searching 0x' + q.toString(16) + ' selects trace entry ' + first + ' (got ' + entry + ')');
  check(r.searchSegments === r.searchExpected, name + ': ' + r.searchSegments + ' segments after event #' + r.searchEvent + ', the trace says ' + r.searchExpected);
  await page.locator('#ev-list').focus();
  for (let i = 0; i < 3; i++) await page.keyboard.press('ArrowDown');
  await page.keyboard.press('ArrowUp');
  header = await page.evaluate(() => ({ ...document.getElementById('st-header').dataset }));
  check(+header.event === Math.min(r.searchEvent + 2, info.data.events - 1), name + ': arrow keys move through the events');
  await page.screenshot({ path: path.join(args.out, shot + '-state.png') });
  // Only the stitching policy has physical pieces to show.
  check(await page.evaluate(() => document.getElementById('tabbtn-pieces').hidden), name + ': no pieces tab (not the stitching policy)');

  check(problems.length === 0, name + ': no console errors, page errors or requests: ' + problems.slice(0, 5).join('; '));
  r.problems = problems;
  await context.close();
  console.log('  first frame ' + r.firstFrameMs + ' ms, ' + r.finalSegments + ' segments at the end, page ' + (r.pageBytes / 1048576).toFixed(2) + ' MiB');
  results.pages.push(r);
}

// Pans the zoomed-in timeline by dragging; the render times of its frames.
async function measurePan(page) {
  const box = await page.locator('#tl-chart').boundingBox();
  const cx = box.x + box.width / 2, cy = box.y + box.height / 2;
  await page.mouse.move(cx, cy);
  for (let i = 0; i < 5; i++) { await page.mouse.wheel(0, -300); await nextFrame(page); }
  const times = [];
  await page.mouse.move(cx + 200, cy);
  await page.mouse.down();
  for (let i = 1; i <= 12; i++) {
    await page.mouse.move(cx + 200 - i * 40, cy);
    await nextFrame(page);
    times.push(await page.evaluate(() => window.__viz.lastRenderMs));
  }
  await page.mouse.up();
  const view = await page.evaluate(() => window.__viz.view());
  return { maxMs: Math.max(...times), meanMs: times.reduce((a, b) => a + b, 0) / times.length, view };
}

async function testFirstFrame(browser, file) {
  // Three fresh loads: the slowest must be within budget.
  const html = path.join(args.work, path.basename(file) + '.html');
  if (!fs.existsSync(html)) ccalloc('viz', file, '-o', html);  // not among --sample's files
  const times = [];
  for (let i = 0; i < 3; i++) {
    const { context, info } = await openPage(browser, html);
    times.push(Math.round(info.firstFrameMs));
    await context.close();
  }
  results.firstFrame = { file: path.basename(file), runsMs: times };
  console.log('== first frame of ' + path.basename(file) + ': ' + times.join(', ') + ' ms');
  check(Math.max(...times) < FIRST_FRAME_BUDGET_MS, path.basename(file) + ': first frame within ' + FIRST_FRAME_BUDGET_MS + ' ms');
}

async function testOom(browser, traces) {
  console.log('== OOM page: gpt2_train_varlen.csv.gz replayed on 10.2 GiB');
  const html = path.join(args.work, 'gpt2_oom_10.2GiB.html');
  ccalloc('viz', path.join(traces, 'gpt2_train_varlen.csv.gz'), '--capacity', '10.2GiB', '-o', html);
  const { context, page, problems } = await openPage(browser, html);
  const badge = await page.textContent('#oom-badge');
  check(+badge > 0, 'OOM page: the OOM tab counts the OOMs (' + badge + ')');
  await page.keyboard.press('3');
  await nextFrame(page);
  const text = await page.innerText('#oom-page');
  check(/Tried to allocate/.test(text), 'OOM page: states the request');
  check(/Largest free block it could use/.test(text), 'OOM page: compares it with the largest free block');
  check(/Fragmentation/.test(text) && /expandable_segments:True/.test(text), 'OOM page: blames fragmentation and suggests expandable_segments:True');
  check(/Verified by replay/.test(text), 'OOM page: the suggestion is verified by replay');
  check(/Where the free bytes are stranded/.test(text) && (await page.locator('#oom-page tr[data-seg]').count()) > 0, 'OOM page: lists the segments stranding free bytes');
  await page.screenshot({ path: path.join(args.out, 'oom-explainer.png'), fullPage: false });
  await page.click('[data-act=state]');
  await nextFrame(page);
  const header = await page.evaluate(() => ({ ...document.getElementById('st-header').dataset }));
  const oomEvent = await page.evaluate(() => window.__viz.app.data.ooms[0].event);
  check(+header.event === oomEvent, 'OOM page: opens the allocator state at the OOM');
  await page.screenshot({ path: path.join(args.out, 'oom-state.png') });
  await page.keyboard.press('1');
  await nextFrame(page);
  await page.screenshot({ path: path.join(args.out, 'oom-timeline.png') });
  await page.keyboard.press('4');
  await nextFrame(page);
  const summary = await page.innerText('#summary-page');
  check(/PyTorch CUDA memory summary/.test(summary) && /CUDA OOMs: [1-9]/.test(summary), 'summary: memory_summary() with the OOM count');
  await page.screenshot({ path: path.join(args.out, 'oom-summary.png') });
  check(problems.length === 0, 'OOM page: no console errors, page errors or requests: ' + problems.slice(0, 5).join('; '));
  results.oom = { badge: +badge };
  await context.close();
}

// The stitching policy's pieces tab: a trace replayed under it, against `ccalloc summary`
// of the same replay's snapshot: one row per address range with the same live, dead and
// unmapped pages and fragmentation; every page's cell agrees with those counts; no piece
// is live behind two pages; each dead page's piece is live where the page says it was
// lent; hovering a cell names its piece.
function physicalRowsFromSummary(text) {
  const lines = text.split('\n');
  const at = lines.findIndex((l) => l.startsWith('range '));
  if (at < 0) throw new Error('ccalloc summary printed no physical ranges table');
  const rows = [];
  for (const l of lines.slice(at + 1)) {
    if (!l.startsWith('0x')) break;
    const f = l.trim().split(/\s+/);
    rows.push({ address: f[0], live: +f[4], dead: +f[5], unmapped: +f[6], frag: f[9] + '%' });
  }
  return rows;
}

async function testPieces(browser, traces) {
  const conf = 'ccalloc,stitch_segments:True';
  // moe_train: its replay ends with pages lent (dead where they were) in both pools.
  const trace = path.join(traces, 'moe_train.csv.gz');
  console.log('== pieces: moe_train.csv.gz replayed under ' + conf);
  const html = path.join(args.work, 'moe_stitching.html');
  ccalloc('viz', trace, '--conf', conf, '-o', html);
  const snap = path.join(args.work, 'moe_stitching.pickle.gz');
  ccalloc('replay', trace, '--conf', conf, '--address-oracle', '--snapshot-out', snap);
  const expected = physicalRowsFromSummary(ccalloc('summary', snap));
  const { context, page, problems } = await openPage(browser, html);
  check(!(await page.evaluate(() => document.getElementById('tabbtn-pieces').hidden)), 'pieces: the tab is shown');
  await page.keyboard.press('5');
  await nextFrame(page);
  const rows = await page.evaluate(() => [...document.querySelectorAll('#pc-ranges tr[data-range]')].map((tr) => ({
    address: tr.cells[0].innerText, live: +tr.dataset.live, dead: +tr.dataset.dead, unmapped: +tr.dataset.unmapped,
    frag: (100 * +tr.dataset.frag).toFixed(1) + '%' })));
  check(expected.length > 0 && JSON.stringify(rows) === JSON.stringify(expected),
    'pieces: the ranges table equals ccalloc summary\'s: ' + JSON.stringify(rows) + ' vs ' + JSON.stringify(expected));
  check(expected.some((r) => r.dead > 0), 'pieces: the replay has dead pages to show');
  const cells = await page.evaluate(() => {
    const ranges = window.__viz.app.data.meta.physical.ranges;
    const out = { counts: [], twice: 0, badLent: 0, dead: 0 };
    const live = new Map();
    const pages = ranges.map((r, ri) => Array.from({ length: r.pages }, (_, i) => window.__viz.piecePage(ri, i)));
    for (const list of pages) {
      const n = { live: 0, dead: 0, unmapped: 0 };
      for (const p of list) {
        n[p.state]++;
        if (p.state === 'live') { const k = p.handle + ':' + p.piece; if (live.has(k)) out.twice++; live.set(k, p.address); }
      }
      out.counts.push(n);
    }
    for (const list of pages) {
      for (const p of list) {
        if (p.state !== 'dead') continue;
        out.dead++;
        const at = live.get(p.handle + ':' + p.piece);
        if ((at === undefined ? 0 : at) !== p.lentTo) out.badLent++;
      }
    }
    return out;
  });
  check(JSON.stringify(cells.counts) === JSON.stringify(expected.map((r) => ({ live: r.live, dead: r.dead, unmapped: r.unmapped }))),
    'pieces: the cells of each range count its live, dead and unmapped pages: ' + JSON.stringify(cells.counts));
  check(cells.twice === 0, 'pieces: no piece is live behind two pages (' + cells.twice + ')');
  check(cells.dead > 0 && cells.badLent === 0, 'pieces: every dead page\'s piece is live where it was lent (' + cells.badLent + ' of ' + cells.dead + ' not)');
  const box = await page.locator('canvas.pc-strip').first().boundingBox();
  await page.mouse.move(box.x + 2, box.y + 2);
  await nextFrame(page);
  const tip = await page.evaluate(() => { const t = document.getElementById('tooltip'); return t.hidden ? '' : t.innerText; });
  check(/Piece\s+\d+ of handle \d+/.test(tip), 'pieces: hovering a page names its piece (' + tip.replace(/\n/g, ' ') + ')');
  await page.screenshot({ path: path.join(args.out, 'pieces.png') });
  check(problems.length === 0, 'pieces: no console errors, page errors or requests: ' + problems.slice(0, 5).join('; '));
  results.pieces = { ranges: rows, deadPages: cells.dead };
  await context.close();
}

// gpt2's trace seven times over (addresses shifted by 1 TiB per copy, times by its
// duration): 1.2 million entries with a real allocation pattern.
function writeBigTrace(traces, file) {
  const lines = zlib.gunzipSync(fs.readFileSync(path.join(traces, 'gpt2_train_varlen.csv.gz'))).toString().trim().split('\n');
  const body = lines.slice(1);
  const t0 = BigInt(body[0].split(',')[4]), t1 = BigInt(body[body.length - 1].split(',')[4]);
  const out = [lines[0]];
  for (let i = 0n; i < 7n; i++) {
    const shift = i << 40n, dt = i * (t1 - t0 + 1000n);
    for (const l of body) {
      const [a, addr, size, stream, t] = l.split(',');
      out.push(a + ',' + (a === 'oom' ? addr : (BigInt(addr) + shift).toString()) + ',' + size + ',' + stream + ',' + (BigInt(t) + dt));
    }
  }
  fs.writeFileSync(file, zlib.gzipSync(out.join('\n') + '\n', { level: 1 }));
  return out.length - 1;
}

async function testBig(browser, traces) {
  const csv = path.join(args.work, 'gpt2_x7_1.2M.csv.gz');
  const entries = writeBigTrace(traces, csv);
  console.log('== big trace: ' + entries.toLocaleString('en-US') + ' entries');
  const html = path.join(args.work, 'gpt2_x7_1.2M.html');
  const [, vizMs] = timed(() => ccalloc('viz', csv, '-o', html));
  const { context, page, problems, info } = await openPage(browser, html);
  const pan = await measurePan(page);
  const ink = await inkFraction(page);
  await page.screenshot({ path: path.join(args.out, 'big-1.2M-timeline.png') });
  results.big = { entries, events: info.data.events, allocations: info.data.allocations, detail: info.data.detail, vizMs,
    pageBytes: fs.statSync(html).size, firstFrameMs: Math.round(info.firstFrameMs), firstRenderMs: info.renderMs, pan };
  console.log('  ccalloc viz ' + vizMs + ' ms, page ' + (results.big.pageBytes / 1048576).toFixed(1) + ' MiB, first frame ' + results.big.firstFrameMs +
    ' ms, pan frames: mean ' + pan.meanMs.toFixed(1) + ' ms, max ' + pan.maxMs.toFixed(1) + ' ms');
  check(ink > 0.01, 'big trace: the timeline has a drawing');
  check(results.big.firstFrameMs < BIG_FIRST_FRAME_BUDGET_MS, 'big trace: first frame within ' + BIG_FIRST_FRAME_BUDGET_MS + ' ms');
  check(pan.maxMs < BIG_PAN_FRAME_BUDGET_MS, 'big trace: every pan frame renders within ' + BIG_PAN_FRAME_BUDGET_MS + ' ms');
  check(problems.length === 0, 'big trace: no console errors, page errors or requests: ' + problems.slice(0, 5).join('; '));
  await context.close();
}

// --sample: one trace file of each kind (the name's part after the workload: csv.gz,
// expandable.csv.gz, pickle.gz, expandable.pickle.gz, frames.pickle.gz, ...) instead of
// all, the k-th kind taking its k-th file (in name order, wrapping) so that the workloads
// vary; every reader and view is still exercised. scripts/test runs this; scripts/test-viz
// alone runs every file.
function sampleOfEachKind(files) {
  const kinds = new Map();
  for (const f of files) {
    const kind = f.slice(f.indexOf('.') + 1);
    if (!kinds.has(kind)) kinds.set(kind, []);
    kinds.get(kind).push(f);
  }
  return [...kinds.values()].map((group, k) => group[k % group.length]).sort();
}

(async () => {
  const started = Date.now();
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM || '/usr/bin/chromium', args: CHROMIUM_ARGS });
  try {
    let files = fs.readdirSync(args.traces).filter((f) => /\.(pickle|json|csv)(\.gz)?$/.test(f)).sort()
      .filter((f) => !args.only || f.includes(args.only));
    if (args.sample) files = sampleOfEachKind(files);
    check(files.length > 0, 'trace files in ' + args.traces);
    for (const f of files) await testTrace(browser, path.join(args.traces, f));
    // A plain (not gzip'd) JSON snapshot with stacks: the format PyTorch's newest viewer reads.
    const frames = path.join(args.traces, 'resnet50_train.frames.pickle.gz');
    if (fs.existsSync(frames) && !args.only) {
      const json = path.join(args.work, 'resnet50_train.frames.json');
      ccalloc('convert', frames, json);
      await testTrace(browser, json);
    }
    const gpt2 = path.join(args.traces, 'gpt2_train_varlen.pickle.gz');
    if (fs.existsSync(gpt2) && !args.only) {
      await testFirstFrame(browser, gpt2);
      await testOom(browser, args.traces);
      await testPieces(browser, args.traces);
      if (args.big) await testBig(browser, args.traces);
    }
  } catch (e) {
    failures.push('exception: ' + (e && e.stack ? e.stack : e));
    console.log(e);
  } finally {
    await browser.close();
  }
  results.seconds = (Date.now() - started) / 1000;
  results.failures = failures;
  fs.writeFileSync(path.join(args.out, 'results.json'), JSON.stringify(results, null, 2));
  console.log('\nfile                                     first frame  segments (end)  segments (search)');
  for (const r of results.pages) {
    console.log(r.file.padEnd(40) + ' ' + String(r.firstFrameMs + ' ms').padStart(11) + '  ' + (r.finalSegments + '/' + r.expectedSegments).padStart(14) +
      '  ' + (r.searchSegments + '/' + r.searchExpected).padStart(17));
  }
  console.log('\nviz tests: ' + (failures.length ? failures.length + ' FAILED' : 'all passed') + ' in ' + results.seconds.toFixed(1) + ' s; screenshots and results.json in ' + args.out);
  process.exit(failures.length ? 1 : 0);
})();
