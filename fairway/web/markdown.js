/*
 * Markdown for the assistant's replies, rendered into DOM nodes. Text only ever enters the page as
 * text nodes (append(string), textContent), never through innerHTML, so no HTML the model writes
 * (or quotes from the user) becomes live markup. Links are made for http(s) URLs alone, and open
 * in a new tab that gets no hold on this page (rel="noopener noreferrer").
 *
 * What it knows is what chat models write: fenced code blocks, ATX headings (#), bulleted and
 * numbered lists (nested by indentation), block quotes, rules, GFM tables; inline code, bold,
 * italic, strikethrough, links and bare URLs. A mark that is not closed stays text, so a reply
 * streaming in shows `**bo` until its closing `**` arrives. The page renders a streaming reply
 * again as its tokens arrive, so everything here is linear in the text's length.
 *
 * Markdown.render(text) -> a DocumentFragment.
 */
'use strict';

const Markdown = (() => {
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)[^`]*$/; // (```a``` on one line is inline code)
  const FENCE_CLOSE = /^ {0,3}(`{3,}|~{3,})\s*$/;
  const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
  const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
  const QUOTE = /^ {0,3}> ?(.*)$/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
  const TABLE_RULE = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
  const BLANK = /^\s*$/;
  const ESCAPABLE = /[!-\/:-@\[-`{-~]/; // ASCII punctuation: what a backslash makes literal
  const SAFE_URL = /^https?:\/\/[^\s]+$/i;
  const BARE_URL = /https?:\/\/[^\s<>"'`]+/iy;
  const SPECIAL = /[\\`*_~[!<]|https?:\/\//gi; // where an inline mark can start
  // Emphasis marks by the length of their run: *x* em, **x** strong, ***x*** both, ~~x~~ del.
  const EMPHASIS = {
    '*': { 1: ['em'], 2: ['strong'], 3: ['strong', 'em'] },
    _: { 1: ['em'], 2: ['strong'], 3: ['strong', 'em'] },
    '~': { 2: ['del'] },
  };

  function el(tag, text) {
    const node = document.createElement(tag);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const indentOf = (line) => line.length - line.trimStart().length;

  // -- blocks ----------------------------------------------------------------------------------

  /** Each block parser takes the line at i if it starts its kind of block: it appends the block
   * to parent and returns the index past it, or returns null. A paragraph takes the rest. */
  const BLOCKS = [fence, heading, rule, quote, list, table];

  function blocks(lines, parent) {
    let i = 0;
    while (i < lines.length) {
      if (BLANK.test(lines[i])) {
        i += 1;
        continue;
      }
      let next = null;
      for (const block of BLOCKS) {
        next = block(lines, i, parent);
        if (next !== null) break;
      }
      i = next ?? paragraph(lines, i, parent);
    }
    return parent;
  }

  /** Whether the line at i starts a block other than a paragraph (and so ends a paragraph). */
  function startsBlock(lines, i) {
    const line = lines[i];
    return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line)
      || isTableStart(lines, i);
  }

  function paragraph(lines, i, parent) {
    const text = [lines[i].trimStart()];
    for (i += 1; i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines, i); i += 1) {
      text.push(lines[i].trimStart());
    }
    parent.append(inline(text.join('\n'), el('p')));
    return i;
  }

  /** A fenced code block; one not closed yet (still streaming) runs to the end of the text. */
  function fence(lines, i, parent) {
    const open = FENCE.exec(lines[i]);
    if (!open) return null;
    const mark = open[1];
    let end = i + 1;
    for (; end < lines.length; end += 1) {
      const close = FENCE_CLOSE.exec(lines[end]);
      if (close && close[1][0] === mark[0] && close[1].length >= mark.length) break;
    }
    const code = el('code', lines.slice(i + 1, end).join('\n'));
    if (open[2]) code.dataset.lang = open[2];
    const pre = el('pre');
    pre.append(code);
    parent.append(pre);
    return end + 1;
  }

  function heading(lines, i, parent) {
    const m = HEADING.exec(lines[i]);
    if (!m) return null;
    parent.append(inline(m[2] || '', el(`h${m[1].length}`)));
    return i + 1;
  }

  function rule(lines, i, parent) {
    if (!RULE.test(lines[i])) return null;
    parent.append(el('hr'));
    return i + 1;
  }

  function quote(lines, i, parent) {
    const inner = [];
    for (let m; i < lines.length && (m = QUOTE.exec(lines[i])); i += 1) inner.push(m[1]);
    if (!inner.length) return null;
    parent.append(blocks(inner, el('blockquote')));
    return i;
  }

  /** A list: its items are the lines with a marker of its kind at its indentation; an item goes
   * on over the lines indented past that (a nested list, a second paragraph). */
  function list(lines, i, parent) {
    const first = ITEM.exec(lines[i]);
    if (!first) return null;
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const sameKind = (m) => m && m[1].length === indent && /\d/.test(m[2]) === ordered;
    const listEl = el(ordered ? 'ol' : 'ul');
    if (ordered && parseInt(first[2], 10) !== 1) listEl.start = parseInt(first[2], 10);
    for (;;) {
      const m = ITEM.exec(lines[i]);
      const [body, next] = itemLines(lines, i + 1, indent, indent + m[2].length + 1);
      const li = blocks([m[3] || '', ...body], el('li'));
      // A tight item (no blank line in it) shows its text without a paragraph's margins.
      if (!body.some((line) => BLANK.test(line))) {
        for (const p of [...li.children].filter((c) => c.tagName === 'P')) p.replaceWith(...p.childNodes);
      }
      listEl.append(li);
      i = next;
      let after = i; // blank lines between items keep the list going
      while (after < lines.length && BLANK.test(lines[after])) after += 1;
      if (after >= lines.length || !sameKind(ITEM.exec(lines[after]))) break;
      i = after;
    }
    parent.append(listEl);
    return i;
  }

  /** The lines of an item after its first, from i, dedented; and the index past them. */
  function itemLines(lines, i, indent, contentIndent) {
    const body = [];
    while (i < lines.length) {
      const line = lines[i];
      if (BLANK.test(line)) {
        let next = i;
        while (next < lines.length && BLANK.test(lines[next])) next += 1;
        if (next >= lines.length || indentOf(lines[next]) <= indent) break;
        body.push(...lines.slice(i, next).map(() => ''));
        i = next;
      } else if (indentOf(line) > indent) {
        body.push(line.slice(Math.min(indentOf(line), contentIndent)));
        i += 1;
      } else if (!startsBlock(lines, i)) {
        body.push(line); // a paragraph's lazy continuation line (wrapped without indentation)
        i += 1;
      } else {
        break;
      }
    }
    return [body, i];
  }

  function isTableStart(lines, i) {
    const rule = lines[i + 1];
    return lines[i].includes('|') && rule !== undefined && rule.includes('|') && TABLE_RULE.test(rule);
  }

  /** A GFM table: a header row, its rule (which sets each column's alignment), then rows. */
  function table(lines, i, parent) {
    if (!isTableStart(lines, i)) return null;
    const align = cells(lines[i + 1]).map((c) => {
      if (c.endsWith(':')) return c.startsWith(':') ? 'center' : 'right';
      return c.startsWith(':') ? 'left' : '';
    });
    const row = (line, tag) => {
      const tr = el('tr');
      cells(line).slice(0, align.length).forEach((text, n) => {
        const cell = inline(text, el(tag));
        if (align[n]) cell.style.textAlign = align[n];
        tr.append(cell);
      });
      return tr;
    };
    const head = el('thead');
    head.append(row(lines[i], 'th'));
    const body = el('tbody');
    for (i += 2; i < lines.length && lines[i].includes('|') && !BLANK.test(lines[i]); i += 1) {
      body.append(row(lines[i], 'td'));
    }
    const tableEl = el('table');
    tableEl.append(head, body);
    parent.append(tableEl);
    return i;
  }

  function cells(line) {
    const trimmed = line.trim().replace(/^\|/, '').replace(/(?<!\\)\|$/, '');
    return trimmed.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, '|'));
  }

  // -- inline ----------------------------------------------------------------------------------

  /**
   * The inline markdown of text appended to parent (returned). Left to right: an escape, a code
   * span, a link, a bare URL, emphasis; else the character is text. `misses` remembers, per kind
   * of closing mark, the position after which none was found: whether a mark can close does not
   * depend on where its opener was, so a later opener of that kind cannot find one either (this
   * keeps a text of many unclosed marks, common mid-stream, linear).
   */
  function inline(text, parent, links = true) {
    const misses = new Map();
    let plain = '';
    let i = 0;
    while (i < text.length) {
      SPECIAL.lastIndex = i; // the text up to the next place a mark can start is plain, whole
      const next = SPECIAL.exec(text);
      const at = next ? next.index : text.length;
      plain += text.slice(i, at);
      if (at === text.length) break;
      i = at;
      const c = text[i];
      if (c === '\\' && ESCAPABLE.test(text[i + 1] || '')) {
        plain += text[i + 1];
        i += 2;
        continue;
      }
      const span = codeSpan(text, i, misses) || (links && (link(text, i) || bareUrl(text, i)))
        || emphasis(text, i, misses, links);
      if (!span) {
        plain += c;
        i += 1;
        continue;
      }
      if (plain) parent.append(plain); // a text node: never parsed as HTML
      plain = '';
      parent.append(span.node);
      i = span.end;
    }
    if (plain) parent.append(plain);
    return parent;
  }

  const runLength = (text, i) => {
    let end = i;
    while (text[end] === text[i]) end += 1;
    return end - i;
  };

  /** `code`: up to a run of as many backticks; an unclosed run is text. */
  function codeSpan(text, i, misses) {
    if (text[i] !== '`') return null;
    const n = runLength(text, i);
    const key = `code${n}`;
    let close = -1;
    if (!(misses.get(key) <= i)) {
      for (let j = text.indexOf('`', i + n); j >= 0; j = text.indexOf('`', j + runLength(text, j))) {
        if (runLength(text, j) === n) {
          close = j;
          break;
        }
      }
    }
    if (close < 0) {
      misses.set(key, i);
      return { node: text.slice(i, i + n), end: i + n };
    }
    let code = text.slice(i + n, close).replace(/\n/g, ' ');
    if (/^ .*[^ ].* $/.test(code)) code = code.slice(1, -1);
    return { node: el('code', code), end: close + n };
  }

  /** [label](url) and ![alt](url): a link for an http(s) URL (an image too: no image is loaded
   * from a URL the model chose); anything else is left as text. */
  function link(text, i) {
    const bang = text[i] === '!' ? 1 : 0;
    if (text[i + bang] !== '[') return null;
    const labelEnd = matching(text, i + bang, '[', ']');
    if (labelEnd < 0 || text[labelEnd + 1] !== '(') return null;
    const urlEnd = matching(text, labelEnd + 1, '(', ')');
    if (urlEnd < 0) return null;
    const url = text.slice(labelEnd + 2, urlEnd).trim().split(/\s+/)[0].replace(/^<(.*)>$/, '$1');
    if (!SAFE_URL.test(url)) return null;
    return { node: anchor(url, text.slice(i + bang + 1, labelEnd)), end: urlEnd + 1 };
  }

  /** The index of the bracket closing the one at i (nested pairs and escapes skipped), or -1.
   * Within its line: a link does not span lines, and an unclosed '[' then costs a line, not the
   * rest of the text. */
  function matching(text, i, open, close) {
    if (text.indexOf(close, i) < 0) return -1; // (a quick no: many unclosed '[' stay linear)
    let depth = 0;
    for (let j = i; j < text.length && text[j] !== '\n'; j += 1) {
      if (text[j] === '\\') j += 1;
      else if (text[j] === open) depth += 1;
      else if (text[j] === close && --depth === 0) return j;
    }
    return -1;
  }

  /** A bare http(s) URL (or one in <...>), without the punctuation that ends its sentence. */
  function bareUrl(text, i) {
    const angled = text[i] === '<' ? 1 : 0;
    if (text[i + angled] !== 'h' || /\w/.test(text[i - 1] || '')) return null;
    BARE_URL.lastIndex = i + angled;
    const m = BARE_URL.exec(text);
    if (!m) return null;
    let url = m[0];
    if (angled) {
      if (text[i + 1 + url.length] !== '>') return null;
      return { node: anchor(url, url, false), end: i + url.length + 2 };
    }
    url = url.replace(/[.,;:!?*_~]+$/, '');
    while (url.endsWith(')') && url.split('(').length < url.split(')').length) url = url.slice(0, -1);
    return { node: anchor(url, url, false), end: i + url.length };
  }

  function anchor(url, label, markdown = true) {
    const a = el('a');
    a.setAttribute('href', url);
    a.target = '_blank';
    a.rel = 'noopener noreferrer';
    if (markdown) inline(label, a, false); // no links inside a link
    else a.textContent = label;
    return a;
  }

  /** *em*, **strong**, ***both***, _em_, __strong__, ~~del~~: an opener is a run of marks followed
   * by a non-space; its closer the next run as long, after a non-space. An intraword _ is text
   * (snake_case). A run that opens nothing is text, whole. */
  function emphasis(text, i, misses, links) {
    const mark = text[i];
    if (!EMPHASIS[mark]) return null;
    const n = runLength(text, i);
    const tags = EMPHASIS[mark][n];
    const literal = { node: text.slice(i, i + n), end: i + n };
    if (!tags || /\s/.test(text[i + n] || ' ') || (mark === '_' && /\w/.test(text[i - 1] || ''))) return literal;
    const close = closer(text, i + n, mark, n, misses);
    if (close < 0) return literal;
    const outer = el(tags[0]);
    const inner = tags.slice(1).reduce((node, tag) => node.appendChild(el(tag)), outer);
    inline(text.slice(i + n, close), inner, links);
    return { node: outer, end: close + n };
  }

  function closer(text, from, mark, n, misses) {
    const key = mark.repeat(n);
    if (misses.get(key) <= from) return -1;
    for (let j = text.indexOf(mark, from); j >= 0; j = text.indexOf(mark, j + runLength(text, j))) {
      const fits = runLength(text, j) === n && !/\s/.test(text[j - 1]);
      if (fits && !(mark === '_' && /\w/.test(text[j + n] || ''))) return j;
    }
    misses.set(key, from);
    return -1;
  }

  function render(text) {
    return blocks(text.split(/\r?\n/), document.createDocumentFragment());
  }

  return { render };
})();
