// The operator dashboard's live updates: no library, nothing fetched from elsewhere.
//
// The page listens to the staff-only event stream; after events arrive it fetches every
// panel's HTML (rendered on the server) and swaps it in, at most once per REFRESH_MS. The
// "Latest events" panel is one of them (rendered with the page, so never empty on load);
// each streamed event is also put at its top at once, until the next swap. Open
// runs in the tree are remembered and sent along, so the tree stays as the operator left it.
// While the stream is down the browser reconnects on its own and the page polls meanwhile.
(function () {
  "use strict";
  var REFRESH_MS = 500;
  var POLL_MS = 5000;

  function start() {
    var root = document.getElementById("rs-dashboard");
    if (!root) return;
    var live = document.getElementById("rs-live");
    var updatedAt = document.getElementById("rs-updated-at");
    var project = root.dataset.project || "";
    // As many events as the server lists (dashboard.selectors.LATEST_EVENTS).
    var eventsShown = parseInt(root.dataset.eventsShown, 10);
    var expanded = new Set();
    var pending = null;
    var inFlight = false;
    var again = false;
    var poller = null;

    root.querySelectorAll("details[data-run-id][open]").forEach(function (d) { expanded.add(d.dataset.runId); });

    function query() {
      var params = new URLSearchParams();
      if (project) params.set("project", project);
      if (expanded.size) params.set("expanded", Array.from(expanded).join(","));
      return params.toString();
    }

    function setLive(state, text) {
      live.dataset.state = state;
      live.textContent = text;
    }

    function refresh() {
      pending = null;
      if (inFlight) { again = true; return; }
      inFlight = true;
      fetch(root.dataset.panelsUrl + "?" + query(), { credentials: "same-origin", headers: { Accept: "application/json" } })
        .then(function (response) { if (!response.ok) throw new Error(response.status); return response.json(); })
        .then(function (body) {
          Object.keys(body.panels).forEach(function (name) {
            var panel = root.querySelector('[data-panel="' + name + '"]');
            if (panel) panel.innerHTML = body.panels[name];
          });
          updatedAt.textContent = new Date(body.at).toLocaleTimeString();
          root.dataset.refreshedAt = body.at;
        })
        .catch(function () { setLive("polling", "refresh failed, retrying"); })
        .finally(function () {
          inFlight = false;
          if (again) { again = false; schedule(); }
        });
    }

    function schedule() {
      if (pending === null) pending = setTimeout(refresh, REFRESH_MS);
    }

    function showEvent(data) {
      // Looked up each time: a panel swap replaces the list.
      var eventList = document.getElementById("rs-events");
      if (!eventList) return;
      var first = eventList.querySelector(".rs-muted");
      if (first) first.remove();
      var item = document.createElement("li");
      item.textContent = new Date(data.createdAt).toLocaleTimeString() + "  " + data.type + "  " + (data.subjectId || "");
      eventList.insertBefore(item, eventList.firstChild);
      while (eventList.children.length > eventsShown) eventList.removeChild(eventList.lastChild);
    }

    // Choosing a project reloads the page for it (here, not inline: the CSP allows no inline handler).
    var projectSelect = root.querySelector('select[name="project"]');
    if (projectSelect) projectSelect.addEventListener("change", function () { projectSelect.form.submit(); });

    // Opening or closing a run in the tree: remember it and fetch its children.
    root.addEventListener("toggle", function (event) {
      var details = event.target;
      if (!details.dataset || !details.dataset.runId) return;
      var id = details.dataset.runId;
      var known = expanded.has(id);
      if (details.open && !known) { expanded.add(id); refresh(); }
      if (!details.open && known) { expanded.delete(id); }
    }, true);

    function startPolling() {
      if (poller === null) poller = setInterval(refresh, POLL_MS);
    }
    function stopPolling() {
      if (poller !== null) { clearInterval(poller); poller = null; }
    }

    if (!window.EventSource) {
      setLive("polling", "polling every " + POLL_MS / 1000 + " s");
      startPolling();
      return;
    }
    var url = root.dataset.streamUrl + (project ? "?project=" + encodeURIComponent(project) : "");
    var source = new EventSource(url, { withCredentials: true });
    source.addEventListener("open", function () {
      setLive("live", "live");
      stopPolling();
      schedule(); // catch up with whatever happened while disconnected
    });
    source.addEventListener("runstate", function (message) {
      showEvent(JSON.parse(message.data));
      schedule();
    });
    source.addEventListener("error", function () {
      setLive("polling", "reconnecting (polling meanwhile)");
      startPolling();
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
