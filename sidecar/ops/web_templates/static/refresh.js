// sidecar web: refresh the parts of a page marked data-refresh="URL" every data-every
// seconds, with the HTML fragment the server renders (and escapes) at URL. No build step.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("[data-refresh]").forEach(function (element) {
    var every = Math.max(1, Number(element.dataset.every) || 5) * 1000;
    function refresh() {
      fetch(element.dataset.refresh, {credentials: "same-origin", cache: "no-store"})
        .then(function (response) { return response.ok ? response.text() : null; })
        .then(function (html) { if (html !== null) { element.innerHTML = html; } })
        .catch(function () {})
        .finally(function () { setTimeout(refresh, every); });
    }
    setTimeout(refresh, every);
  });
});
