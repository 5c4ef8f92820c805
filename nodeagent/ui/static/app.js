// nodeagent's operator page: draws the charts whose data each chart's element carries (data-series: JSON in an
// attribute; never inline script, which the page's policy forbids and htmx drops from what it swaps in), again after
// each live refresh swaps the page in.
(function () {
  "use strict";
  var COLORS = ["#175cd3", "#12804a", "#b54708", "#c01048", "#6941c6", "#0e9384", "#667085", "#dd2590"];

  function draw(root) {
    if (typeof uPlot === "undefined") return;
    root.querySelectorAll("[data-chart]").forEach(function (el) {
      if (el.dataset.drawn) return;
      var c;
      try { c = JSON.parse(el.dataset.series || "null"); } catch (e) { return; }
      if (!c || !c.x || c.x.length === 0) return;
      var series = [{}];
      var data = [c.x];
      c.series.forEach(function (s, i) {
        series.push({ label: s.label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true });
        data.push(s.values);
      });
      if (c.series.length === 0) { series.push({ label: "none", stroke: COLORS[6] }); data.push(c.x.map(function () { return null; })); }
      var opts = { width: Math.max(300, el.clientWidth || 380), height: 180, series: series,
                   scales: { x: { time: true } }, axes: [{}, { size: 40 }], legend: { show: true } };
      el.dataset.drawn = "1";
      el.dataset.last = JSON.stringify(c.series.map(function (s) { return s.values[s.values.length - 1]; }));
      new uPlot(opts, data, el);
    });
  }

  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSettle", function () { draw(document); });
})();
