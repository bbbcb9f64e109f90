// The pieces tab (stitching policy only, meta.physical; see viz/page.cpp physical_json):
// which physical pieces back which pages of each address range at the snapshot, the dead
// pages (mapping a piece lent to a later page), the unmapped ones and the spare pieces,
// with each range's free bytes and fragmentation. Reserved bytes are the handles' pieces:
// the segments' pages plus the spare pieces; address space is not memory.
//
// Each range is a strip of cells, one per page below its frontier, in address order:
//   live      the piece's colour (one per handle), its free share drawn light from the top
//   dead      dark, crossed: the mapping stays, the memory is counted where the piece lives
//   unmapped  an empty outline: address space only
// Spare pieces are cells of their handles' colours in a strip of their own.

const PG_UNMAPPED = 0, PG_LIVE = 1, PG_DEAD = 2;
const DEAD_COLOR = '#3b3f46', UNMAPPED_COLOR = '#d9dde3';

// A handle's colour: the palette by handle id, so the pieces of one handle match.
const handleColor = (h) => PALETTE[(h * 7) % PALETTE.length];

class PiecesView {
  constructor(app) {
    this.app = app;
    this.p = app.data.meta.physical;
    this.cols = app.data.pieceCols;
  }

  render() {
    const p = this.p, html = [];
    const row = (cells, th) => '<tr>' + cells.map((c, i) => (th ? '<th' : '<td') + (i >= 3 && !th ? ' class="num"' : '') + '>' + c + (th ? '</th>' : '</td>')).join('') + '</tr>';
    html.push('<div class="card" id="pc-totals"><h2>Physical memory</h2><p>' +
      fmtInt(p.handles) + ' handles of ' + fmtSize(p.piece_size) + ' pieces hold <b>' + fmtSizeFull(p.held) + '</b> (reserved) = ' +
      fmtSize(p.segment_bytes) + ' behind the segments\u2019 pages + ' + fmtSize(p.spare_bytes) + ' in ' + fmtInt(p.spare_pieces) +
      (p.spare_pieces === 1 ? ' spare piece. ' : ' spare pieces. ') + fmtInt(p.dead_pages) +
      (p.dead_pages === 1 ? ' dead page maps a piece' : ' dead pages map pieces') + ' lent to later pages: address space, not memory.</p>' +
      (p.problems.length ? p.problems.map((w) => '<div class="warn">' + esc(w) + '</div>').join('') : '') +
      '<div class="legend"><span><i class="sw" style="background:' + PALETTE[0] + '"></i>Live page (colour: its handle; light top: free share)</span>' +
      '<span><i class="sw" style="background:' + DEAD_COLOR + '"></i>Dead page (piece lent elsewhere)</span>' +
      '<span><i class="sw" style="background:' + UNMAPPED_COLOR + '"></i>Unmapped</span></div></div>');
    html.push('<div class="card"><h2>Ranges</h2><table class="grid" id="pc-ranges">' +
      row(['Range', 'Pool', 'Stream', 'Mapped', 'Live pages', 'Dead pages', 'Unmapped', 'Free inside', 'Largest free', 'Fragmentation'], true) +
      p.ranges.map((r, i) => '<tr data-range="' + i + '" data-live="' + r.live_pages + '" data-dead="' + r.dead_pages + '" data-unmapped="' + r.unmapped_pages +
        '" data-frag="' + r.fragmentation + '">' + ['<code>' + hex(r.address) + '</code>', r.small ? 'small' : 'large', esc(r.stream), fmtSize(r.mapped),
        fmtInt(r.live_pages), fmtInt(r.dead_pages), fmtInt(r.unmapped_pages), fmtSize(r.free), fmtSize(r.largest_free), pct(r.fragmentation)]
        .map((c, k) => '<td' + (k >= 3 ? ' class="num"' : '') + '>' + c + '</td>').join('') + '</tr>').join('') +
      '</table><p class="muted">Fragmentation = 1 \u2212 largest free block / free bytes inside the range\u2019s segments: the share of its free bytes a request as large as all of them could not use in place (stitching lends their whole pages instead).</p></div>');
    for (let i = 0; i < p.ranges.length; i++) {
      const r = p.ranges[i];
      html.push('<div class="card pc-range"><h3>' + (r.small ? 'Small' : 'Large') + ' pool, stream ' + esc(r.stream) + ' \u2014 <code>' + hex(r.address) + '</code>, ' +
        fmtInt(r.pages) + ' pages, ' + fmtInt(r.segments) + ' segments</h3><canvas class="pc-strip" data-range="' + i + '"></canvas></div>');
    }
    if (p.spare.length) {
      html.push('<div class="card pc-range"><h3>Spare pieces (held, live nowhere)</h3><canvas class="pc-strip" id="pc-spare"></canvas></div>');
    }
    if (!p.pages_shown) html.push('<p class="muted">Too many pages to draw one cell each: the table above has the figures.</p>');
    const page = $('pieces-page');
    page.innerHTML = html.join('');
    for (const c of page.querySelectorAll('canvas.pc-strip')) {
      if (c.id === 'pc-spare') this.drawSpare(c);
      else if (p.pages_shown) this.drawRange(c, p.ranges[+c.dataset.range]);
    }
  }

  // Cell size: 10 px for a few pages, down to 2 px for many, in rows of the card's width.
  layout(canvas, count) {
    const width = Math.max(200, canvas.parentElement.clientWidth - 32);
    const cell = count <= 512 ? 10 : count <= 4096 ? 6 : count <= 32768 ? 3 : 2;
    const perRow = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(count / perRow));
    const dpr = window.devicePixelRatio || 1;
    canvas.style.width = perRow * cell + 'px';
    canvas.style.height = rows * cell + 'px';
    canvas.width = Math.round(perRow * cell * dpr);
    canvas.height = Math.round(rows * cell * dpr);
    const ctx = canvas.getContext('2d');
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    return { ctx, cell, perRow };
  }

  drawRange(canvas, r) {
    const c = this.cols, { ctx, cell, perRow } = this.layout(canvas, r.pages);
    const gap = cell >= 6 ? 1 : 0;
    for (let i = 0; i < r.pages; i++) {
      const k = r.first_page + i, x = (i % perRow) * cell, y = Math.floor(i / perRow) * cell;
      const s = c.state[k], w = cell - gap;
      if (s === PG_LIVE) {
        ctx.fillStyle = handleColor(c.handle[k]);
        ctx.fillRect(x, y, w, w);
        const free = c.free[k] / 255;
        if (free > 0) { ctx.fillStyle = 'rgba(255,255,255,0.75)'; ctx.fillRect(x, y, w, Math.max(1, Math.round(w * free))); }
      } else if (s === PG_DEAD) {
        ctx.fillStyle = DEAD_COLOR;
        ctx.fillRect(x, y, w, w);
        if (cell >= 6) { ctx.strokeStyle = '#e15759'; ctx.beginPath(); ctx.moveTo(x + 1, y + 1); ctx.lineTo(x + w - 1, y + w - 1); ctx.stroke(); }
      } else {
        ctx.fillStyle = UNMAPPED_COLOR;
        ctx.fillRect(x, y, w, w);
      }
    }
    canvas.onmousemove = (ev) => this.hover(ev, canvas, r, cell, perRow);
    canvas.onmouseleave = () => tooltip.hide();
  }

  drawSpare(canvas) {
    const pieces = [];
    for (const [h, first, count] of this.p.spare) for (let i = 0; i < count && pieces.length < 1 << 20; i++) pieces.push([h, first + i]);
    const { ctx, cell, perRow } = this.layout(canvas, pieces.length);
    const gap = cell >= 6 ? 1 : 0;
    pieces.forEach(([h], i) => {
      ctx.fillStyle = handleColor(h);
      ctx.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
    });
    canvas.onmousemove = (ev) => {
      const i = this.cellAt(ev, canvas, cell, perRow);
      if (i < 0 || i >= pieces.length) { tooltip.hide(); return; }
      tooltip.show('<b>Spare piece</b><div class="kv"><span>Handle</span><span>' + pieces[i][0] + '</span><span>Piece</span><span>' + pieces[i][1] +
        '</span><span>Size</span><span>' + fmtSize(this.p.piece_size) + '</span></div><div class="muted">Held (reserved), mapped live nowhere: the next growth of any range takes it first.</div>', ev.clientX, ev.clientY);
    };
    canvas.onmouseleave = () => tooltip.hide();
  }

  cellAt(ev, canvas, cell, perRow) {
    const b = canvas.getBoundingClientRect();
    const col = Math.floor((ev.clientX - b.left) / cell), row = Math.floor((ev.clientY - b.top) / cell);
    return col < 0 || col >= perRow || row < 0 ? -1 : row * perRow + col;
  }

  // What one page is: its address, state and piece (test hook: viz.piecePage).
  pageInfo(r, i) {
    const c = this.cols, k = r.first_page + i, g = this.p.piece_size;
    const info = { address: r.address + i * g, state: ['unmapped', 'live', 'dead'][c.state[k]] };
    if (c.state[k] !== PG_UNMAPPED) { info.handle = c.handle[k]; info.piece = c.piece[k]; }
    if (c.state[k] === PG_LIVE) info.free = Math.round((c.free[k] / 255) * g);
    if (c.state[k] === PG_DEAD) info.lentTo = c.lent[k];
    return info;
  }

  hover(ev, canvas, r, cell, perRow) {
    const i = this.cellAt(ev, canvas, cell, perRow);
    if (i < 0 || i >= r.pages) { tooltip.hide(); return; }
    const p = this.pageInfo(r, i), rows = [['Page', hex(p.address)], ['State', p.state]];
    if (p.handle !== undefined) rows.push(['Piece', p.piece + ' of handle ' + p.handle]);
    if (p.free !== undefined) rows.push(['Free in page', fmtSize(p.free)]);
    if (p.lentTo !== undefined) rows.push(['Piece now', p.lentTo ? 'live at ' + hex(p.lentTo) : 'spare']);
    const note = p.state === 'dead' ? 'The old mapping stays until empty_cache or the OOM ladder unmaps it; it holds no memory of its own.'
      : p.state === 'unmapped' ? 'Address space only.' : 'Backed by its own piece: counted in reserved bytes.';
    tooltip.show('<div class="kv">' + rows.map(([k, v]) => '<span>' + k + '</span><span>' + v + '</span>').join('') + '</div><div class="muted">' + note + '</div>', ev.clientX, ev.clientY);
  }
}
