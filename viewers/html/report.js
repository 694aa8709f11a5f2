/* pdtrace report page script (inlined into the page by viewers/html/report.py).
 *
 * 1. Unpacks the embedded data (gzip + base64, DecompressionStream) and builds the event
 *    table (paged; filters: text, kind, process, request, step; go to an event id).
 * 2. Unpacks plotly.js and draws every figure; each figure whose x axis is time carries its
 *    current range in data-xrange ("lo,hi", ms).
 * 3. Finding navigation: clicking a finding (a findings-table row or a count in the summary)
 *    zooms every time-axis figure to the finding's range (Plotly.relayout) and lists and
 *    highlights the events it cites in the table (rows get data-highlighted="1"); a cited id
 *    (#107) opens that event among all events (data-focus="1"). n / p step through findings.
 *    The selected finding's crosses are drawn larger and black, the others faded
 *    (selectedpoints on the "finding" traces, by the event ids in their customdata); its
 *    request's block map is outlined (data-selected="1") and the drafter-window figure
 *    zooms to its request's rows. Clicking an event-table row zooms every time axis to a
 *    window around that event and draws a line at it (body[data-pd-zoomed-event]).
 *
 * Test hooks: ?autoclick=K selects finding K (0-based) once the figures are drawn and then
 * sets body[data-pd-clicked=K]; ?clickev=N then clicks event N's table row and sets
 * body[data-pd-evclicked=N]; ?ev=N (or #ev-N) opens event N. body[data-pd-rendered] is
 * the number of figures drawn, body[data-pd-error] a rendering failure.
 */
(function () {
  "use strict";
  var status = document.getElementById("pd-status");
  var body = document.body;
  var D = null;
  var figsReady = false;
  var selected = -1;
  var params = new URLSearchParams(window.location.search);

  function $(id) { return document.getElementById(id); }
  function esc(s) {
    return String(s).replace(/[&<>"]/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c];
    });
  }
  function bytesOf(id) {
    var bin = atob($(id).textContent.trim());
    var out = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  function gunzip(id) {
    var stream = new Blob([bytesOf(id)]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).text();
  }

  // ------------------------------------------------------------------ event table
  var T = { E: null, rows: [], pos: new Map(), filtered: [], page: 0, size: 100, cited: null, citedFrom: -1,
            highlight: {}, focus: null };
  var F_IDS = ["pd-ev-q", "pd-ev-kind", "pd-ev-lane", "pd-ev-req", "pd-ev-step"];

  function val(id) { var el = $(id); return el ? el.value.trim() : ""; }
  function parseStep(s) {
    if (!s) return null;
    var m = /^(-?\d+)\s*(?:-|–|\.\.)\s*(-?\d+)$/.exec(s);
    if (m) return [+m[1], +m[2]];
    if (/^-?\d+$/.test(s)) return [+s, +s];
    return null;
  }
  function filterActive() {
    return T.cited !== null || F_IDS.some(function (id) { return val(id) !== ""; });
  }
  function clearFilters() {
    F_IDS.forEach(function (id) { var el = $(id); if (el) el.value = ""; });
    T.cited = null;
    T.citedFrom = -1;
  }

  function initTable(E) {
    T.E = E;
    T.rows = E.rows;
    T.rows.forEach(function (r, i) { T.pos.set(r[0], i); });
    var counts = E.kinds.map(function () { return 0; });
    var reqs = new Set();
    T.rows.forEach(function (r) { counts[r[5]]++; if (r[4] != null) reqs.add(String(r[4])); });
    var kindSel = $("pd-ev-kind");
    var prefixes = {};
    E.kinds.forEach(function (k, i) { var p = k.split(".")[0]; prefixes[p] = (prefixes[p] || 0) + counts[i]; });
    var opts = [];
    Object.keys(prefixes).sort().forEach(function (p) {
      opts.push('<option value="' + esc(p) + '.*">' + esc(p) + ".* (" + prefixes[p] + ")</option>");
      E.kinds.map(function (k, i) { return [k, i]; }).filter(function (ki) { return ki[0].split(".")[0] === p; })
        .sort().forEach(function (ki) {
          opts.push('<option value="' + esc(ki[0]) + '">&nbsp;&nbsp;' + esc(ki[0]) + " (" + counts[ki[1]] + ")</option>");
        });
    });
    kindSel.insertAdjacentHTML("beforeend", opts.join(""));
    $("pd-ev-lane").insertAdjacentHTML("beforeend", E.lanes.map(function (l, i) {
      return '<option value="' + i + '">' + esc(l) + "</option>";
    }).join(""));
    $("pd-ev-reqs").innerHTML = Array.from(reqs).sort().slice(0, 3000).map(function (r) {
      return '<option value="' + esc(r) + '">';
    }).join("");
    F_IDS.forEach(function (id) {
      $(id).addEventListener("input", function () { T.cited = null; T.citedFrom = -1; applyFilters(); });
    });
    $("pd-ev-clear").addEventListener("click", function () { clearFilters(); T.focus = null; applyFilters(); });
    $("pd-ev-size").addEventListener("change", function () { T.size = +val("pd-ev-size") || 100; T.page = 0; renderTable(); });
    $("pd-ev-id").addEventListener("keydown", function (ev) {
      if (ev.key === "Enter") { var n = parseInt(val("pd-ev-id").replace("#", ""), 10); if (!isNaN(n)) goToEvent(n); }
    });
    document.querySelectorAll(".pager button[data-page]").forEach(function (b) {
      b.addEventListener("click", function () {
        var pages = Math.max(1, Math.ceil(T.filtered.length / T.size));
        var w = b.getAttribute("data-page");
        T.page = w === "first" ? 0 : w === "last" ? pages - 1 : w === "next" ? T.page + 1 : T.page - 1;
        renderTable();
      });
    });
    applyFilters();
  }

  function applyFilters(keepPage) {
    var E = T.E, rows = T.rows;
    var q = val("pd-ev-q").toLowerCase(), kind = val("pd-ev-kind"), lane = val("pd-ev-lane");
    var req = val("pd-ev-req").toLowerCase(), step = parseStep(val("pd-ev-step"));
    var prefix = kind.slice(-2) === ".*" ? kind.slice(0, -1) : null;
    var out = [];
    for (var i = 0; i < rows.length; i++) {
      var r = rows[i];
      if (T.cited !== null && !T.cited.has(r[0])) continue;
      if (kind) {
        var k = E.kinds[r[5]];
        if (prefix ? k.indexOf(prefix) !== 0 : k !== kind) continue;
      }
      if (lane !== "" && r[2] !== +lane) continue;
      if (req && (r[4] == null || String(r[4]).toLowerCase().indexOf(req) < 0)) continue;
      if (step && (r[3] == null || r[3] < step[0] || r[3] > step[1])) continue;
      if (q) {
        var hay = ("#" + r[0] + " " + E.kinds[r[5]] + " " + (r[4] == null ? "" : r[4]) + " " + E.lanes[r[2]] + " " +
                   r[6]).toLowerCase();
        if (hay.indexOf(q) < 0) continue;
      }
      out.push(i);
    }
    T.filtered = out;
    if (!keepPage) T.page = 0;
    renderTable();
  }

  function rowHtml(r) {
    var E = T.E, id = r[0];
    return '<tr id="ev-' + id + '" data-ev="' + id + '"' + (T.highlight[id] ? ' data-highlighted="1"' : "") +
      (T.focus === id ? ' data-focus="1"' : "") + '><td><a class="evlink" href="#ev-' + id + '" data-ev="' + id + '">' +
      id + "</a></td><td>" + r[1].toFixed(3) + "</td><td>" + esc(E.lanes[r[2]]) + "</td><td>" +
      (r[3] == null ? "" : r[3]) + "</td><td>" + esc(r[4] == null ? "" : r[4]) + "</td><td>" + esc(E.kinds[r[5]]) +
      '</td><td class="fields" title="' + esc(r[6]) + '">' + esc(r[6]) + "</td></tr>";
  }
  function gapHtml(n, where) {
    return '<tr class="gap"><td colspan="7">… ' + n + " event(s) " + where + " not embedded in this page …</td></tr>";
  }

  function renderTable() {
    var n = T.filtered.length, pages = Math.max(1, Math.ceil(n / T.size));
    T.page = Math.min(Math.max(T.page, 0), pages - 1);
    var a = T.page * T.size, b = Math.min(n, a + T.size), plain = !filterActive();
    var html = [], prev = a > 0 ? T.rows[T.filtered[a - 1]][0] : -1;
    for (var j = a; j < b; j++) {
      var r = T.rows[T.filtered[j]];
      if (plain && r[0] > prev + 1) html.push(gapHtml(r[0] - prev - 1, "here"));
      prev = r[0];
      html.push(rowHtml(r));
    }
    if (plain && b === n && T.E.total - 1 > prev && T.E.trimmed) html.push(gapHtml(T.E.total - 1 - prev, "after this"));
    if (!n) html.push('<tr><td colspan="7" class="note">no event matches the filters</td></tr>');
    $("pd-ev-body").innerHTML = html.join("");
    $("pd-ev-pageinfo").textContent = n ? ("rows " + (a + 1) + "–" + b + " of " + n + (plain ? "" : " matching") +
      " · page " + (T.page + 1) + " / " + pages) : "0 rows";
    var ban = $("pd-ev-banner");
    if (T.cited !== null && T.citedFrom >= 0) {
      var f = D.findings[T.citedFrom];
      ban.hidden = false;
      ban.innerHTML = "Listing the " + T.cited.size + " event(s) cited by finding " + (T.citedFrom + 1) + ": <b>" +
        esc(f.title) + '</b> <button type="button" id="pd-ev-context">show them among all events</button>';
      $("pd-ev-context").addEventListener("click", function () {
        var first = D.findings[T.citedFrom].ids[0];
        if (first != null) showInContext(first);
      });
    } else {
      ban.hidden = true;
    }
  }

  function baseHighlight() {
    T.highlight = {};
    if (selected >= 0) D.findings[selected].ids.forEach(function (i) { T.highlight[i] = true; });
  }
  function showInContext(id) {
    // the event among all events (no filter), the selected finding's events still highlighted
    clearFilters();
    baseHighlight();
    applyFilters();
    return goToEvent(id);
  }

  function goToEvent(id, keepFocus) {
    if (!T.pos.has(id)) {
      var ban = $("pd-ev-banner");
      ban.hidden = false;
      ban.textContent = "Event #" + id + " is not embedded in this page (left out to keep it small): open the trace " +
        "with pdtrace view.";
      return false;
    }
    var i = T.pos.get(id);
    var j = T.filtered.indexOf(i);
    if (j < 0) { clearFilters(); applyFilters(); j = i; }
    if (!keepFocus) T.focus = id;
    T.highlight[id] = true;
    T.page = Math.floor(j / T.size);
    renderTable();
    var row = $("ev-" + id);
    if (row) row.scrollIntoView({ block: "center" });
    body.setAttribute("data-pd-focus", String(id));
    return true;
  }

  // ------------------------------------------------------------------ figures and findings
  function markRange(el) {
    var ax = el._fullLayout && el._fullLayout.xaxis;
    if (ax && ax.range) el.setAttribute("data-xrange", (+ax.range[0]).toFixed(4) + "," + (+ax.range[1]).toFixed(4));
  }
  function band(f) {
    // the cited events' span, shaded on every time axis while the finding is selected
    if (!f || !f.span) return [];
    var w = Math.max(f.span[1] - f.span[0], (f.x[1] - f.x[0]) * 0.01);
    var mid = (f.span[0] + f.span[1]) / 2;
    return [{ type: "rect", xref: "x", yref: "paper", x0: mid - w / 2, x1: mid + w / 2, y0: 0, y1: 1,
              fillcolor: "rgba(253, 224, 71, 0.28)", line: { width: 0 }, layer: "below" }];
  }
  function zoom(x, f, atEvent) {
    if (!figsReady || !window.Plotly) return Promise.resolve();
    var upd = x ? { "xaxis.range": [x[0], x[1]], "xaxis.autorange": false } : { "xaxis.autorange": true };
    if (f !== undefined) {
      upd.shapes = band(f);
      if (atEvent != null) {
        upd.shapes = upd.shapes.concat([{ type: "line", xref: "x", yref: "paper", x0: atEvent, x1: atEvent, y0: 0,
                                          y1: 1, line: { color: "#1d4ed8", width: 2, dash: "dot" } }]);
      }
    }
    return Promise.all(D.timefigs.map(function (id) {
      var el = $(id);
      if (!el || !el._fullLayout) return null;
      return window.Plotly.relayout(el, upd).then(function () { markRange(el); });
    }));
  }

  function markFinding(f) {
    // the selected finding's crosses: larger and black; every other cross faded
    if (!figsReady || !window.Plotly) return Promise.resolve();
    var ids = f ? new Set(f.ids) : null;
    return Promise.all(Object.keys(D.figs).map(function (id) {
      var el = $(id);
      if (!el || !el.data) return null;
      var idx = [], pts = [];
      el.data.forEach(function (tr, t) {
        if (tr.name !== "finding" || !tr.customdata) return;
        idx.push(t);
        pts.push(ids ? tr.customdata.reduce(function (a, c, i) { if (ids.has(c)) a.push(i); return a; }, []) : null);
      });
      if (!idx.length) return null;
      return window.Plotly.restyle(el, {
        selectedpoints: pts,
        "selected.marker.color": "#111827", "selected.marker.size": 20,
        "unselected.marker.opacity": 0.25
      }, idx).then(function () {
        el.setAttribute("data-marked", ids ? String(pts.reduce(function (a, p) { return a + p.length; }, 0)) : "");
      });
    }));
  }

  function focusRequestFigures(f) {
    // outline the block map(s) of the finding's request; zoom the drafter-window figure to its rows
    var reqs = f ? f.reqs || [] : [];
    var maps = [];
    Object.keys(D.reqfigs || {}).forEach(function (id) {
      var el = $(id), on = reqs.some(function (r) { return D.reqfigs[id].indexOf(r) >= 0; });
      if (!el) return;
      if (on) { el.setAttribute("data-selected", "1"); maps.push(id); } else el.removeAttribute("data-selected");
    });
    var links = maps.map(function (id) {
      return '<a href="#' + id + '">block map of ' + esc(D.reqfigs[id].join(" / ")) + "</a>";
    });
    var win = $("fig-windows");
    if (win && win.data && figsReady) {
      var labels = [];
      win.data.forEach(function (tr) { (tr.y || []).forEach(function (y) { if (labels.indexOf(y) < 0) labels.push(y); }); });
      var hit = [];
      labels.forEach(function (y, i) {
        var ok = reqs.some(function (r) { return y.indexOf(r + " ") === 0; }) &&
          (f.step == null || f.kind !== "drafter-window-outside-allocation" || y.indexOf(" s" + f.step + " ") > 0);
        if (ok) hit.push(i);
      });
      if (hit.length) {
        window.Plotly.relayout(win, { "yaxis.range": [Math.min.apply(null, hit) - 0.6, Math.max.apply(null, hit) + 0.6],
                                      "yaxis.autorange": false });
        win.setAttribute("data-selected", "1");
        links.push('<a href="#fig-windows">drafter write window' + (hit.length > 1 ? "s" : "") + "</a>");
      } else if (win.hasAttribute("data-selected")) {
        window.Plotly.relayout(win, { "yaxis.autorange": true });
        win.removeAttribute("data-selected");
      }
    }
    var where = $("pd-sel-figs");
    if (where) where.innerHTML = links.length ? " · see: " + links.join(", ") : "";
  }

  function zoomToEvent(id) {
    // an event-table row: every time axis to a window around the event, a line at it
    var i = T.pos.get(id);
    if (i === undefined || !figsReady) return Promise.resolve();
    var t = T.rows[i][1], n = T.rows.length;
    var whole = n ? T.rows[n - 1][1] - T.rows[0][1] : 0;
    var half = Math.max(whole * 0.01, 0.5);
    var f = selected >= 0 ? D.findings[selected] : null;
    if (f && f.x) half = Math.max(half, (f.x[1] - f.x[0]) / 2);
    body.setAttribute("data-pd-zoomed-event", String(id));
    return zoom([t - half, t + half], f, t);
  }

  function selText(k) {
    var f = D.findings[k];
    return '<b>Finding ' + (k + 1) + " / " + D.findings.length + "</b> " + esc(f.sev) + " · " + esc(f.kind) +
      (f.inst ? " · " + esc(f.inst) : "") + (f.step != null ? " · step " + f.step : "") +
      (f.req ? " · " + esc(f.req) : "") + " · " + esc(f.title) +
      (f.x ? " · <b>" + f.x[0].toFixed(3) + "–" + f.x[1].toFixed(3) + " ms</b>" : " · (no time: cited events absent)");
  }

  function selectFinding(k) {
    if (!D || k < 0 || k >= D.findings.length) return Promise.resolve();
    selected = k;
    var f = D.findings[k];
    document.querySelectorAll("tr.finding").forEach(function (tr) {
      var on = +tr.getAttribute("data-finding") === k;
      tr.classList.toggle("sel", on);
      if (on) tr.setAttribute("aria-selected", "true"); else tr.removeAttribute("aria-selected");
    });
    var row = $("finding-" + (k + 1)), wrap = row && row.closest(".findwrap");
    if (row && wrap) {
      var top = row.offsetTop - wrap.offsetTop;
      if (top < wrap.scrollTop || top > wrap.scrollTop + wrap.clientHeight - 40) wrap.scrollTop = top - 40;
    }
    clearFilters();
    T.cited = new Set(f.ids);
    T.citedFrom = k;
    T.highlight = {};
    T.focus = null;
    f.ids.forEach(function (id) { T.highlight[id] = true; });
    applyFilters();
    $("pd-sel").hidden = false;
    $("pd-sel-text").innerHTML = selText(k);
    body.setAttribute("data-selected-finding", String(k));
    focusRequestFigures(f);
    return Promise.all([zoom(f.x, f), markFinding(f)]);
  }
  function unselect() {
    selected = -1;
    document.querySelectorAll("tr.finding.sel").forEach(function (tr) { tr.classList.remove("sel"); });
    $("pd-sel").hidden = true;
    body.removeAttribute("data-selected-finding");
    if (figsReady) D.timefigs.forEach(function (id) { var el = $(id); if (el && el._fullLayout) window.Plotly.relayout(el, { shapes: [] }); });
    markFinding(null);
    focusRequestFigures(null);
    body.removeAttribute("data-pd-zoomed-event");
    clearFilters();
    T.highlight = {};
    T.focus = null;
    applyFilters();
  }

  function initNav() {
    document.addEventListener("click", function (ev) {
      var t = ev.target;
      var a = t.closest ? t.closest("a") : null;
      if (a && a.classList.contains("evlink")) {
        ev.preventDefault();
        var id = +a.getAttribute("data-ev");
        var frow = a.closest("tr.finding");
        var k = frow ? +frow.getAttribute("data-finding") : -1;
        if (k >= 0 && k !== selected) selectFinding(k); // zoom to the finding, keep its rows highlighted
        showInContext(id);
        history.replaceState(null, "", "#ev-" + id);
        return;
      }
      if (a && a.classList.contains("selfind")) {
        ev.preventDefault();
        var n = +a.getAttribute("data-finding");
        selectFinding(n);
        var r = $("finding-" + (n + 1));
        if (r) r.scrollIntoView({ block: "center" });
        return;
      }
      if (a && a.classList.contains("filtreq")) {
        ev.preventDefault();
        clearFilters();
        $("pd-ev-req").value = a.getAttribute("data-req");
        applyFilters();
        $("events").scrollIntoView({ block: "start" });
        return;
      }
      if (a || (t.closest && t.closest("details, pre, button, input, select"))) return;
      var tr = t.closest ? t.closest("tr.finding") : null;
      if (tr) { selectFinding(+tr.getAttribute("data-finding")); return; }
      var er = t.closest ? t.closest("#pd-ev-body tr[data-ev]") : null;
      if (er) {
        var eid = +er.getAttribute("data-ev");
        T.focus = eid;
        document.querySelectorAll("#pd-ev-body tr[data-focus]").forEach(function (x) { x.removeAttribute("data-focus"); });
        er.setAttribute("data-focus", "1");
        zoomToEvent(eid);
      }
    });
    document.addEventListener("keydown", function (ev) {
      var tag = (ev.target && ev.target.tagName) || "";
      if (/INPUT|SELECT|TEXTAREA/.test(tag) || ev.ctrlKey || ev.metaKey || ev.altKey || !D.findings.length) return;
      if (ev.key === "Enter" && ev.target.classList && ev.target.classList.contains("finding")) {
        selectFinding(+ev.target.getAttribute("data-finding"));
      } else if (ev.key === "n") {
        selectFinding(Math.min(selected + 1, D.findings.length - 1));
      } else if (ev.key === "p") {
        selectFinding(Math.max(selected - 1, 0));
      }
    });
    $("pd-sel-next").addEventListener("click", function () { selectFinding(Math.min(selected + 1, D.findings.length - 1)); });
    $("pd-sel-prev").addEventListener("click", function () { selectFinding(Math.max(selected - 1, 0)); });
    $("pd-sel-whole").addEventListener("click", function () { zoom(null); });
    $("pd-sel-clear").addEventListener("click", unselect);
    window.addEventListener("hashchange", fromLocation);
  }

  function fromLocation() {
    var m = /^#ev-(\d+)$/.exec(window.location.hash);
    if (m) { showInContext(+m[1]); return; }
    m = /^#finding-(\d+)$/.exec(window.location.hash);
    if (m) selectFinding(+m[1] - 1); // #finding-N: N as the # column numbers it, from 1
  }

  function drawFigures() {
    var figs = D.figs, ids = Object.keys(figs);
    var config = { responsive: true, displaylogo: false, scrollZoom: false };
    return ids.reduce(function (p, id) {
      return p.then(function () {
        var el = $(id);
        if (!el) return null;
        el.style.minHeight = "";
        return window.Plotly.newPlot(el, figs[id].data, figs[id].layout, config);
      });
    }, Promise.resolve()).then(function () {
      figsReady = true;
      D.timefigs.forEach(function (id) { var el = $(id); if (el) markRange(el); });
      // the figures changed the page's height: bring an event opened from the URL back into view
      var row = T.focus !== null ? $("ev-" + T.focus) : null;
      if (row) row.scrollIntoView({ block: "center" });
      status.textContent = "";
      body.setAttribute("data-pd-rendered", String(ids.length));
    });
  }

  if (typeof DecompressionStream === "undefined") {
    status.textContent = "This browser cannot unpack the embedded figures (needs DecompressionStream: Chrome 80+, Firefox 113+, Safari 16.4+).";
    return;
  }
  gunzip("pd-data").then(function (text) {
    D = JSON.parse(text);
    initTable(D.events);
    initNav();
    if (params.get("ev")) showInContext(+params.get("ev")); else fromLocation();
    return gunzip("pd-plotly");
  }).then(function (js) {
    (0, eval)(js);  // defines window.Plotly
    return drawFigures();
  }).then(function () {
    var k = params.get("autoclick"), ce = params.get("clickev");
    var sel = selected >= 0 ? zoom(D.findings[selected].x, D.findings[selected]) : Promise.resolve();
    if (k !== null) {
      sel = sel.then(function () { return selectFinding(+k); }).then(function () {
        body.setAttribute("data-pd-clicked", k);
      });
    }
    if (ce === null) return sel;
    return sel.then(function () {
      // a real click on the event's table row (the handler a user's click runs)
      goToEvent(+ce, true);
      var row = $("ev-" + ce);
      if (row) row.querySelector("td:nth-child(3)").dispatchEvent(new MouseEvent("click", { bubbles: true }));
      return new Promise(function (res) { setTimeout(res, 300); });
    }).then(function () { body.setAttribute("data-pd-evclicked", ce); });
  }).catch(function (err) {
    status.textContent = "figure rendering failed: " + err;
    body.setAttribute("data-pd-error", String(err));
  });
})();
