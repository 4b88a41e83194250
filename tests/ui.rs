//! The dashboard at `/ui` in a real browser: headless Chromium, driven over WebDriver (fantoccini
//! talking to chromedriver), against the real binary with live data. Screenshots of what the
//! browser showed are saved under `target/ui-screenshots/` for a person to look at.
//!
//! The cluster tests start three real nodes and open the dashboard of the leader and of a
//! follower, which must point to the leader rather than fail on the API's redirects.
//!
//! Needs `chromium` and `chromedriver` (Debian: `apt-get install chromium chromium-driver`); without
//! them the tests are skipped, except under CI (`CI` set), which installs them.

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::{Server, NEVER_HANG};
use fantoccini::elements::Element;
use fantoccini::error::CmdError;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

const TOKEN: &str = "ui-test-token-7f3a9c";

/// The browser's time zone: hours away from UTC, as on an operator's laptop.
const BROWSER_TZ: &str = "America/New_York";

/// One browser at a time: the machine is small, and two Chromiums starting together can make a
/// wait run out for reasons that have nothing to do with the page.
static ONE_BROWSER: Mutex<()> = Mutex::new(());

/// Where the browser and its driver are, or `None` (after saying so) when this machine lacks them.
fn browser_tools() -> Option<(PathBuf, PathBuf)> {
    let find = |names: &[&str]| {
        names.iter().find_map(|n| {
            std::env::var_os("PATH")
                .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(n)).find(|p| p.is_file()))
        })
    };
    let driver = find(&["chromedriver"]);
    let chrome = find(&["chromium", "chromium-browser", "google-chrome"]);
    match (driver, chrome) {
        (Some(d), Some(c)) => Some((d, c)),
        // The tests are ignored unless asked for; asked for, a missing browser is a failure.
        _ => panic!("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)"),
    }
}

/// `target/ui-screenshots`, under `CARGO_TARGET_DIR` when that is set.
fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("ui-screenshots");
    std::fs::create_dir_all(&dir).expect("create screenshot dir");
    dir
}

/// A chromedriver child on a free loopback port, killed on drop.
struct Driver {
    child: Child,
    url: String,
    _tmp: tempfile::TempDir,
}

impl Driver {
    fn start(path: &PathBuf) -> Driver {
        let tmp = tempfile::tempdir().expect("temp dir");
        let port = TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
        let log = std::fs::File::create(tmp.path().join("chromedriver.log")).expect("log");
        let child = Command::new(path)
            .arg(format!("--port={port}"))
            // A browser far from UTC, so a time shown in local time would differ from the UTC one.
            .env("TZ", BROWSER_TZ)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("log")))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start chromedriver");
        let d = Driver { child, url: format!("http://127.0.0.1:{port}"), _tmp: tmp };
        let http = common::client();
        let deadline = Instant::now() + NEVER_HANG;
        loop {
            let ready =
                http.get(format!("{}/status", d.url)).send().ok().and_then(|r| r.json::<Value>().ok());
            if ready.is_some_and(|v| v["value"]["ready"] == true) {
                return d;
            }
            assert!(Instant::now() < deadline, "chromedriver never became ready on {}", d.url);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A browser session, driven step by step from plain (blocking) test code, so the test can make
/// its own HTTP calls between browser steps.
struct Browser {
    rt: tokio::runtime::Runtime,
    client: Option<Client>,
    name: &'static str,
    _profile: tempfile::TempDir,
    _driver: Driver,
}

impl Browser {
    fn open(name: &'static str, driver_path: &PathBuf, chrome: &PathBuf) -> Browser {
        let driver = Driver::start(driver_path);
        let profile = tempfile::tempdir().expect("profile dir");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            format!("--user-data-dir={}", profile.path().display()),
            "--window-size=1280,1000".into(),
        ];
        let caps = json!({
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chrome, "args": args},
        });
        let caps = match caps {
            Value::Object(m) => m,
            _ => unreachable!("a JSON object"),
        };
        let client = rt
            .block_on(
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(caps)
                    .connect(&driver.url),
            )
            .expect("start a Chromium session");
        Browser { rt, client: Some(client), name, _profile: profile, _driver: driver }
    }

    fn c(&self) -> &Client {
        self.client.as_ref().expect("session open")
    }

    fn goto(&self, url: &str) {
        self.rt.block_on(self.c().goto(url)).expect("open the page");
    }

    /// Runs `script` (a function body; `return` gives the value) in the page.
    fn js(&self, script: &str) -> Value {
        self.rt
            .block_on(self.c().execute(script, vec![]))
            .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    fn click(&self, css: &str) {
        self.on_element("click", css, |e| async move { e.click().await });
    }

    fn type_into(&self, css: &str, text: &str) {
        self.on_element("type into", css, |e| async move { e.send_keys(text).await });
    }

    /// Finds `css` and does `act` on it. The page rebuilds its tables on every refresh, so an
    /// element found just before one is gone by the time it is acted on ("stale"); a stale
    /// element took no input, so it is found again and the act retried.
    fn on_element<F, Fut>(&self, what: &str, css: &str, act: F)
    where
        F: Fn(Element) -> Fut,
        Fut: std::future::Future<Output = Result<(), CmdError>>,
    {
        let deadline = Instant::now() + NEVER_HANG;
        loop {
            let done = self.rt.block_on(async { act(self.c().find(Locator::Css(css)).await?).await });
            match done {
                Ok(()) => return,
                Err(e) if e.is_stale_element_reference() && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => self.fail(&format!("{what} {css}: {e}")),
            }
        }
    }

    /// Says yes to the `confirm()` the page just opened (waiting for it to open).
    fn accept_confirm(&self) {
        let deadline = Instant::now() + NEVER_HANG;
        loop {
            match self.rt.block_on(self.c().accept_alert()) {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => self.fail(&format!("no confirm dialog: {e}")),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Polls `script` until it returns something truthy, which it then returns; the page refreshes
    /// on its own schedule, so this never asserts after a fixed sleep.
    fn wait_for(&self, what: &str, script: &str) -> Value {
        let deadline = Instant::now() + NEVER_HANG;
        loop {
            let v = self.js(script);
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => !a.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            if Instant::now() >= deadline {
                self.fail(&format!("waited {NEVER_HANG:?} for {what}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Saves a PNG of the whole page at `width` (the window is made as tall as the page) or, with
    /// `height`, of that viewport only.
    fn screenshot(&self, file: &str, width: u32, height: Option<u32>) -> PathBuf {
        let h = height.unwrap_or(1000);
        self.rt.block_on(self.c().set_window_size(width, h)).expect("resize");
        if height.is_none() {
            let full = self.js("return document.documentElement.scrollHeight").as_u64().unwrap_or(1000);
            // The outer window is a little taller than the viewport it holds.
            let inner = self.js("return window.innerHeight").as_u64().unwrap_or(u64::from(h));
            let extra = u64::from(h).saturating_sub(inner);
            let want = u32::try_from(full + extra).unwrap_or(4000).min(4000);
            self.rt.block_on(self.c().set_window_size(width, want)).expect("resize");
        }
        let png = self.rt.block_on(self.c().screenshot()).expect("screenshot");
        let path = screenshot_dir().join(file);
        std::fs::write(&path, png).expect("save screenshot");
        println!("screenshot: {}", path.display());
        path
    }

    /// Panics with what the page shows, after saving a screenshot of it.
    fn fail(&self, why: &str) -> ! {
        let text = self.rt.block_on(self.c().execute("return document.body.innerText", vec![]));
        let shot = self.rt.block_on(self.c().screenshot()).ok();
        let file = screenshot_dir().join(format!("{}-failure.png", self.name));
        if let Some(png) = shot {
            let _ = std::fs::write(&file, png);
        }
        panic!("{why}\nscreenshot: {}\npage text:\n{}", file.display(), text.unwrap_or(Value::Null))
    }

    /// Starts recording script errors and unhandled rejections from now on.
    fn watch_errors(&self) {
        self.js(
            "window.__uiErrors = [];
             window.addEventListener('error', (e) => window.__uiErrors.push(String(e.message)));
             window.addEventListener('unhandledrejection', (e) => window.__uiErrors.push(String(e.reason)));",
        );
    }

    fn assert_no_errors(&self) {
        let errors = self.js("return window.__uiErrors");
        assert_eq!(errors, json!([]), "the page threw");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(c) = self.client.take() {
            let _ = self.rt.block_on(c.close());
        }
    }
}

/// Levels rows as [level, backlog, next due] texts.
const LEVEL_ROWS: &str = "return Array.from(document.querySelectorAll('#levels tbody tr'))
    .map((r) => Array.from(r.cells).map((c) => c.textContent))";

/// A levels row with a backlog, once the page has shown one.
const A_BUSY_LEVEL: &str = "return Array.from(document.querySelectorAll('#levels tbody tr'))
    .map((r) => Array.from(r.cells).map((c) => c.textContent))
    .find((cells) => Number(cells[1]) > 0) || null";

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn the_dashboard_shows_live_levels_topics_and_messages_and_cancels_one() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);

    for (id, delay_ms) in [("o-1", 60_000), ("o-2", 120_000), ("o-3", 300_000)] {
        s.produce(
            "orders",
            &json!({"id": id, "body": format!("{{\"order\":\"{id}\"}}"), "delay_ms": delay_ms}),
        );
    }
    s.produce("mail", &json!({"id": "m-1", "body": "weekly digest", "delay_ms": 30_000}));
    s.produce("mail", &json!({"id": "m-2", "body": "welcome, ready now"}));
    // One dead letter, for the redrive: a single attempt, given back.
    s.produce("jobs", &json!({"id": "j-1", "body": "resize image 42", "max_attempts": 1}));
    let (popped, _) = s.pop("jobs", 1, 5_000, None);
    let receipt = popped[0]["receipt"].as_str().expect("receipt");
    let (status, nacked) = s.post("/v1/nack", &json!({"receipt": receipt}));
    assert_eq!((status, nacked["state"].clone()), (200, json!("dead")), "{nacked}");

    let b = Browser::open("desktop", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();

    let busy = b.wait_for("a level with a backlog", A_BUSY_LEVEL);
    assert!(busy[2].as_str().is_some_and(|due| due.starts_with("in ")), "next due of a busy level: {busy}");
    let mail = b.wait_for(
        "the mail topic in the topics table",
        "const r = document.querySelector('#topics tbody tr[data-topic=\"mail\"]');
         return r ? Array.from(r.cells).map((c) => c.textContent) : null",
    );
    assert_eq!(mail[1], "1", "mail has one ready message: {mail}");

    let orders = b.wait_for(
        "orders with its delayed count",
        "const r = document.querySelector('#topics tbody tr[data-topic=\"orders\"]');
         return r ? Array.from(r.cells).map((c) => c.textContent) : null",
    );
    assert_eq!(orders[3], "3", "orders has three delayed messages: {orders}");
    assert_eq!(b.js("return document.getElementById('topics-note').hidden"), json!(true));

    // Browse orders' delayed messages: the ids show up in the list.
    b.click("#topics tr[data-topic='orders'] button[aria-label='Browse orders']");
    let ids = b.wait_for(
        "browsed messages of orders",
        "return Array.from(document.querySelectorAll('#messages tbody tr')).map((r) => r.dataset.id)",
    );
    assert!(ids.as_array().is_some_and(|a| a.contains(&json!("o-1"))), "browsed ids {ids}");

    // Redrive jobs.dlq through the page; the message is back in jobs.
    b.click("#topics tr[data-topic='jobs.dlq'] button[aria-label='Redrive jobs.dlq to jobs']");
    b.accept_confirm();
    b.wait_for(
        "the redrive result",
        "return document.getElementById('status').textContent.includes('1 moved')",
    );
    let (_, j1) = s.get("/v1/messages/j-1");
    assert_eq!(j1["topic"], "jobs", "{j1}");
    assert_ne!(j1["state"], "dead", "{j1}");

    // Pause mail through its switch; the API says so and the row shows it.
    b.click("#topics tr[data-topic='mail'] button[aria-label='Pause mail']");
    b.wait_for(
        "mail shown paused",
        "return document.querySelector('#topics tr[data-topic=\"mail\"] .badge.paused') !== null",
    );
    let (_, topics) = s.get("/v1/topics");
    let mail = topics["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "mail").cloned();
    assert_eq!(mail.map(|t| t["paused"].clone()), Some(json!(true)), "{topics}");

    // Look a message up by id: its state and topic are shown.
    b.type_into("#lookup-id", "o-2");
    b.click("#lookup-form button[type=submit]");
    b.wait_for(
        "o-2's state",
        "const e = document.getElementById('lookup-state'); return e && e.textContent === 'delayed'",
    );
    let shown = b.js("return document.getElementById('lookup-fields').innerText");
    assert!(
        shown.as_str().is_some_and(|t| t.contains("orders") && t.contains("\"order\":\"o-2\"")),
        "{shown}"
    );
    // Its history: produced, nothing since.
    let events = b.wait_for(
        "o-2's history",
        "const l = document.querySelectorAll('#lookup-fields ol.history li');
         return l.length ? Array.from(l).map((e) => e.dataset.event) : null",
    );
    assert_eq!(events, json!(["produced"]), "history of o-2");

    // A single node is a cluster of one: no cluster panel, no banner, every action live.
    let single = b.js(
        "return [document.getElementById('cluster').hidden, document.getElementById('leader-banner').hidden,
                 Array.from(document.querySelectorAll('fieldset.live')).some((f) => f.disabled)]",
    );
    assert_eq!(single, json!([true, true, false]), "[cluster hidden, banner hidden, any fieldset disabled]");

    b.screenshot("dashboard-desktop.png", 1280, None);

    // Cancel it through the page; the API agrees.
    b.click("#cancel-msg");
    b.accept_confirm();
    b.wait_for("o-2 cancelled", "return document.getElementById('lookup-state').textContent === 'cancelled'");
    let (status, o2) = s.get("/v1/messages/o-2");
    assert_eq!((status, o2["state"].clone()), (200, json!("cancelled")), "{o2}");

    // A phone-sized screen: the page itself does not scroll sideways (wide tables scroll in place).
    b.screenshot("dashboard-phone.png", 390, Some(844));
    let (page_w, view_w) = (
        b.js("return document.documentElement.scrollWidth"),
        b.js("return document.documentElement.clientWidth"),
    );
    assert!(page_w.as_u64() <= view_w.as_u64(), "page is {page_w} px wide in a {view_w} px viewport");
    b.wait_for("levels still shown on the phone", A_BUSY_LEVEL);
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn with_a_token_the_page_asks_for_it_and_keeps_it_out_of_urls() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN)]);
    let r = s
        .http()
        .post(s.url("/v1/topics/orders/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"id": "secret-order", "body": "x", "delay_ms": 60_000}))
        .send()
        .expect("produce");
    assert_eq!(r.status(), 201);

    let b = Browser::open("token", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    b.wait_for("the token prompt", "return !document.getElementById('auth').hidden");
    assert_eq!(b.js(LEVEL_ROWS), json!([]), "no data shown without the token");
    b.screenshot("dashboard-token-prompt.png", 1280, Some(700));

    b.type_into("#token", TOKEN);
    b.click("#auth-form button[type=submit]");
    b.wait_for("levels after the token", A_BUSY_LEVEL);
    assert_eq!(b.js("return document.getElementById('auth').hidden"), json!(true));
    b.type_into("#lookup-id", "secret-order");
    b.click("#lookup-form button[type=submit]");
    b.wait_for(
        "the message",
        "const e = document.getElementById('lookup-state'); return e && e.textContent === 'delayed'",
    );
    b.wait_for(
        "orders in the topics table",
        "return document.querySelector('#topics tr[data-topic=\"orders\"]')",
    );

    // Every URL the page asked for, its own included: the token is in none of them.
    let urls = b
        .js("return [location.href].concat(performance.getEntriesByType('resource').map((e) => e.name),
                 performance.getEntriesByType('navigation').map((e) => e.name))");
    let urls: Vec<&str> = urls.as_array().expect("urls").iter().filter_map(Value::as_str).collect();
    assert!(urls.iter().any(|u| u.contains("/v1/stats")), "the page's requests: {urls:?}");
    assert!(urls.iter().any(|u| u.contains("/v1/messages/secret-order")), "the page's requests: {urls:?}");
    for u in &urls {
        assert!(!u.contains(TOKEN), "the token is in a URL: {u}");
    }
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn a_compat_topic_name_is_shown_as_written_and_its_buttons_work() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);
    for (id, delay) in [("c-1", 600), ("c-2", 900)] {
        let (st, v) = s
            .post("/push", &json!({"topic": "order:close", "id": id, "delay": delay, "ttr": 60, "body": id}));
        assert_eq!((st, &v["code"]), (200, &json!(0)), "{v}");
    }

    let b = Browser::open("compat-name", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    let row = b.wait_for(
        "order:close in the topics table",
        "const r = document.querySelector('#topics tbody tr[data-topic=\"order:close\"]');
         return r ? Array.from(r.cells).map((c) => c.textContent) : null",
    );
    assert_eq!((&row[0], &row[3]), (&json!("order:close"), &json!("2")), "name and delayed count: {row}");

    b.js("document.getElementById('browse-state').value = 'delayed'");
    b.click("#topics tr[data-topic='order:close'] button[aria-label='Browse order:close']");
    let ids = b.wait_for(
        "browsed messages of order:close",
        "const ids = Array.from(document.querySelectorAll('#messages tbody tr')).map((r) => r.dataset.id);
         return ids.length ? ids : null",
    );
    assert_eq!(ids, json!(["c-1", "c-2"]), "browsed ids");

    b.click("#topics tr[data-topic='order:close'] button[aria-label='Pause order:close']");
    b.wait_for(
        "order:close shown paused",
        "return document.querySelector('#topics tr[data-topic=\"order:close\"] .badge.paused') !== null",
    );
    let (_, topics) = s.get("/v1/topics");
    let t = topics["topics"].as_array().unwrap().iter().find(|t| t["topic"] == "order:close").cloned();
    assert_eq!(t.map(|t| t["paused"].clone()), Some(json!(true)), "{topics}");
    b.screenshot("dashboard-compat-name.png", 1280, Some(900));
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn with_the_read_token_the_page_shows_everything_and_changes_nothing() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    const READ: &str = "ui-read-only-5b1e";
    let s = Server::start(&[("DELAYD_AUTH_TOKEN", TOKEN), ("DELAYD_READ_TOKEN", READ)]);
    let r = s
        .http()
        .post(s.url("/v1/topics/mail/messages"))
        .bearer_auth(TOKEN)
        .json(&json!({"id": "m-1", "body": "x", "delay_ms": 60_000}))
        .send()
        .expect("produce");
    assert_eq!(r.status(), 201);

    let b = Browser::open("read-token", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    b.wait_for("the token prompt", "return !document.getElementById('auth').hidden");
    b.type_into("#token", READ);
    b.click("#auth-form button[type=submit]");
    b.wait_for("levels after the token", A_BUSY_LEVEL);
    b.wait_for(
        "mail in the topics table",
        "return document.querySelector('#topics tr[data-topic=\"mail\"]')",
    );
    b.click("#topics tr[data-topic='mail'] button[aria-label='Pause mail']");
    let said = b.wait_for(
        "the refusal",
        "const s = document.getElementById('status');
         return s.classList.contains('error') && s.textContent.includes('read-only') ? s.textContent : null",
    );
    assert!(said.as_str().is_some_and(|t| t.contains("pause")), "{said}");
    let topics: Value =
        s.http().get(s.url("/v1/topics")).bearer_auth(TOKEN).send().expect("topics").json().expect("json");
    assert_eq!(topics["topics"][0]["paused"], false, "{topics}");
    assert_eq!(b.js("return document.getElementById('auth').hidden"), json!(true), "no new token asked for");

    // It sees the health strip, the charts and the messages; every action on them is refused.
    assert_eq!(b.wait_for("the health strip", HEALTH)["store"], "writable");
    assert_eq!(b.js("return document.getElementById('charts').hidden"), json!(false));
    b.js("document.getElementById('browse-state').value = 'delayed'");
    b.click("#topics tr[data-topic='mail'] button[aria-label='Browse mail']");
    assert_eq!(b.wait_for("mail's delayed message", BROWSED_IDS), json!(["m-1"]));
    b.click("#messages tr[data-id='m-1'] button[data-action='cancel']");
    b.accept_confirm();
    b.wait_for(
        "the cancel refused",
        "const s = document.getElementById('status');
         return s.classList.contains('error') && s.textContent.includes('read-only') && s.textContent.includes('DELETE')",
    );
    b.click("#select-all");
    b.click("#bulk-cancel");
    b.accept_confirm();
    let said = b.wait_for(
        "the bulk cancel refused",
        "const t = document.getElementById('status').textContent; return t.startsWith('Cancel: 0 of 1') ? t : null",
    );
    assert!(said.as_str().is_some_and(|t| t.contains("1 refused") && t.contains("read-only")), "{said}");
    let m1: Value =
        s.http().get(s.url("/v1/messages/m-1")).bearer_auth(TOKEN).send().expect("get").json().expect("json");
    assert_eq!(m1["state"], "delayed", "{m1}");
    let href = b.js("return location.href");
    assert!(href.as_str().is_some_and(|h| h.contains("topic=mail") && !h.contains(READ)), "{href}");
    b.screenshot("dashboard-read-token.png", 1280, None);
    b.assert_no_errors();
}

/// The cluster panel's rows as [node id, role] texts, once it lists `n` nodes.
fn cluster_rows(n: usize) -> String {
    format!(
        "const rows = document.querySelectorAll('#cluster-nodes tbody tr');
         if (document.getElementById('cluster').hidden || rows.length !== {n}) return null;
         return Array.from(rows).map((r) => [r.dataset.node, r.querySelector('[data-role]').textContent])"
    )
}

/// Whether every panel served by the leader is disabled (`[levels, topics, flow, browse, lookup]`).
const LIVE_DISABLED: &str =
    "return Array.from(document.querySelectorAll('fieldset.live')).map((f) => f.disabled)";

/// The banner's text while shown, else null.
const BANNER: &str = "const b = document.getElementById('leader-banner');
    return b.hidden ? null : b.innerText";

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn in_a_cluster_the_leader_lists_its_nodes_and_a_follower_points_to_the_leader() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let c = Cluster::start(3, &[]);
    let leader = c.wait_leader(NEVER_HANG);
    let follower = (1..=3).find(|&i| i != leader).expect("a follower");
    let r = c
        .client()
        .produce("orders", &json!({"id": "o-1", "body": "x", "delay_ms": 600_000}))
        .expect("produce");
    assert!(r.ok(), "{r:?}");

    let b = Browser::open("cluster", &driver, &chrome);
    b.goto(&format!("{}/ui", c.url(leader)));
    b.watch_errors();
    let rows = b.wait_for("three nodes in the cluster panel", &cluster_rows(3));
    let want: Vec<Value> =
        (1..=3).map(|i| json!([i.to_string(), if i == leader { "leader" } else { "follower" }])).collect();
    assert_eq!(rows, json!(want), "the leader's cluster panel");
    // The leader knows how far each node has come: a number in every match index and lag cell.
    let lags = b.js("return Array.from(document.querySelectorAll('#cluster-nodes tbody tr'))
        .map((r) => [r.cells[4].textContent, r.cells[5].textContent])");
    for cell in lags.as_array().expect("rows").iter().flat_map(|r| r.as_array().expect("cells")) {
        assert!(
            cell.as_str().is_some_and(|t| t.parse::<u64>().is_ok()),
            "match index / lag on the leader: {lags}"
        );
    }
    b.wait_for("the leader's levels", A_BUSY_LEVEL);
    assert_eq!(b.js(BANNER), Value::Null, "no banner on the leader");
    assert_eq!(b.js(LIVE_DISABLED), json!([false, false, false, false, false]));
    b.screenshot("cluster-leader.png", 1280, None);

    // A follower's page: the banner names the leader and links to its dashboard, and the panels
    // say where their data is instead of showing the API's redirect as an error.
    b.goto(&format!("{}/ui", c.url(follower)));
    b.watch_errors();
    let banner = b.wait_for("the follower banner", BANNER);
    let says =
        format!("This node ({follower}) is a follower; the leader is node {leader} at {}", c.url(leader));
    assert!(banner.as_str().is_some_and(|t| t.starts_with(&says)), "banner: {banner}");
    let href = b.js("return document.getElementById('leader-link').href");
    assert_eq!(href, json!(format!("{}/ui", c.url(leader))), "the banner's link");
    assert_eq!(b.wait_for("the follower's cluster panel", &cluster_rows(3)), json!(want));
    assert_eq!(b.js(LIVE_DISABLED), json!([true, true, true, true, true]), "panels served by the leader");
    let notes =
        b.js("return Array.from(document.querySelectorAll('.by-leader')).filter((n) => !n.hidden).length");
    assert_eq!(notes, json!(5), "a 'served by the leader' note in each panel");
    assert_eq!(b.js("return document.getElementById('status').textContent"), json!(""), "no error shown");
    let asked = b.js("return performance.getEntriesByType('resource').map((e) => e.name)");
    let asked: Vec<&str> = asked.as_array().expect("urls").iter().filter_map(Value::as_str).collect();
    assert!(asked.iter().any(|u| u.ends_with("/v1/cluster")), "{asked:?}");
    assert!(
        !asked.iter().any(|u| u.contains("/v1/stats")),
        "a follower's page asked for what it cannot get: {asked:?}"
    );
    b.screenshot("cluster-follower.png", 1280, None);
    // On a phone the node table becomes cards and the page does not scroll sideways.
    b.screenshot("cluster-follower-phone.png", 390, Some(844));
    let (page_w, view_w) = (
        b.js("return document.documentElement.scrollWidth"),
        b.js("return document.documentElement.clientWidth"),
    );
    assert!(page_w.as_u64() <= view_w.as_u64(), "page is {page_w} px wide in a {view_w} px viewport");
    b.rt.block_on(b.c().set_window_size(1280, 1000)).expect("resize");

    // The link leads to the leader's dashboard, which has data and no banner.
    b.assert_no_errors();
    b.click("#leader-link");
    b.wait_for(
        "the leader's page after the link",
        &format!("return location.origin === {:?}", c.url(leader)),
    );
    b.watch_errors();
    b.wait_for("the leader's cluster panel after the link", &cluster_rows(3));
    b.wait_for("the leader's levels after the link", A_BUSY_LEVEL);
    assert_eq!(b.js(BANNER), Value::Null);
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn a_leader_that_loses_its_majority_keeps_its_last_figures_greyed_and_its_actions_off() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let c = Cluster::start(3, &[]);
    let leader = c.wait_leader(NEVER_HANG);
    let r = c
        .client()
        .produce("orders", &json!({"id": "o-1", "body": "x", "delay_ms": 600_000}))
        .expect("produce");
    assert!(r.ok(), "{r:?}");

    let b = Browser::open("cluster-lost", &driver, &chrome);
    b.goto(&format!("{}/ui", c.url(leader)));
    b.watch_errors();
    let busy = b.wait_for("the leader's levels", A_BUSY_LEVEL);
    b.wait_for(
        "orders in the topics table",
        "return document.querySelector('#topics tr[data-topic=\"orders\"]')",
    );

    // Cut off from both others, it steps down (check-quorum) and knows no leader; its page says
    // so, keeps what it showed greyed, and no action can be clicked.
    c.isolate(leader);
    let banner = b.wait_for("the no-leader banner", BANNER);
    assert!(
        banner.as_str().is_some_and(|t| t.starts_with(&format!("This node ({leader}) is a"))
            && t.contains("no leader at the moment (election in progress or majority lost)")),
        "banner: {banner}"
    );
    b.wait_for(
        "the panels greyed",
        "return Array.from(document.querySelectorAll('fieldset.live')).every((f) => f.disabled)",
    );
    assert_eq!(b.wait_for("the last levels, still shown", A_BUSY_LEVEL)[0], busy[0]);
    let pause = b.js("const p = document.querySelector('#topics tr[data-topic=\"orders\"] button[aria-label=\"Pause orders\"]');
        return p ? [p.disabled, p.matches(':disabled')] : null");
    assert_eq!(pause, json!([false, true]), "the pause button is disabled by its panel, not taken away");
    let note = b.js("return document.getElementById('topics-by-leader').textContent");
    assert!(note.as_str().is_some_and(|t| t.contains("Greyed")), "{note}");
    assert_eq!(b.js("return document.getElementById('status').textContent"), json!(""), "no error shown");
    b.screenshot("cluster-no-leader.png", 1280, None);

    // Healed, the cluster has a leader again, and this page follows: either this node leads
    // again (no banner, live panels) or the banner names the one that does.
    c.heal();
    let now = c.wait_leader(NEVER_HANG);
    if now == leader {
        b.wait_for(
            "live panels again",
            "return Array.from(document.querySelectorAll('fieldset.live')).every((f) => !f.disabled)",
        );
        b.wait_for("no banner", "return document.getElementById('leader-banner').hidden");
    } else {
        let says = format!("the leader is node {now} at {}", c.url(now));
        b.wait_for("the banner naming the new leader", &format!(
            "const b = document.getElementById('leader-banner'); return !b.hidden && b.innerText.includes({says:?})"
        ));
    }
    b.assert_no_errors();
}

/// The leader of a cluster whose `/v1/cluster` needs the token (the harness asks without one).
fn leader_with_token(c: &Cluster) -> usize {
    let http = common::cluster::short_client(Duration::from_millis(500));
    let deadline = Instant::now() + NEVER_HANG;
    loop {
        let views: Vec<Option<Value>> = (1..=c.size())
            .map(|i| {
                let r = http.get(format!("{}/v1/cluster", c.url(i))).bearer_auth(TOKEN).send().ok()?;
                r.status().is_success().then(|| r.json::<Value>().ok()).flatten()
            })
            .collect();
        if let Some(l) = common::cluster::agreed_leader(&views, c.size()) {
            return l;
        }
        assert!(Instant::now() < deadline, "no leader within {NEVER_HANG:?}: {views:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn with_a_token_a_follower_asks_for_it_and_says_the_leader_will_ask_again() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let c = Cluster::start(3, &[("DELAYD_AUTH_TOKEN", TOKEN)]);
    let leader = leader_with_token(&c);
    let follower = (1..=3).find(|&i| i != leader).expect("a follower");

    let b = Browser::open("cluster-token", &driver, &chrome);
    b.goto(&format!("{}/ui", c.url(follower)));
    b.watch_errors();
    // Without the token even the cluster's view is closed: the prompt, and nothing else.
    b.wait_for("the token prompt", "return !document.getElementById('auth').hidden");
    assert_eq!(b.js(BANNER), Value::Null, "no banner before the token");
    assert_eq!(b.js("return document.getElementById('cluster').hidden"), json!(true));

    b.type_into("#token", TOKEN);
    b.click("#auth-form button[type=submit]");
    let banner = b.wait_for("the follower banner", BANNER);
    assert!(banner.as_str().is_some_and(|t| t.contains(&format!("the leader is node {leader}"))), "{banner}");
    assert_eq!(b.js("return document.getElementById('auth').hidden"), json!(true));
    // Each dashboard keeps the token for its own origin: the banner says the leader's will ask.
    assert_eq!(b.js("return document.getElementById('leader-banner-token').hidden"), json!(false));
    b.wait_for("the cluster panel", &cluster_rows(3));
    b.assert_no_errors();
}

/// Ids of the browsed messages, in the order shown.
const BROWSED_IDS: &str =
    "const ids = Array.from(document.querySelectorAll('#messages tbody tr')).map((r) => r.dataset.id);
     return ids.length ? ids : null";

/// The health strip's facts as {key: text}, once it shows.
const HEALTH: &str = "if (document.getElementById('health').hidden) return null;
    const o = {}; for (const d of document.querySelectorAll('#health-facts dd')) o[d.dataset.fact] = d.textContent;
    return o";

/// The cells of a topic's row, once it shows.
fn topic_row(topic: &str) -> String {
    format!(
        "const r = document.querySelector('#topics tbody tr[data-topic=\"{topic}\"]');
         return r ? Array.from(r.cells).map((c) => c.textContent) : null"
    )
}

/// A loopback port nothing listens on: bound, then let go.
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port()
}

/// Waits until the server's history has `n` samples in which something was produced.
fn wait_for_busy_samples(s: &Server, n: usize) -> Value {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let (status, h) = s.get("/v1/stats/history");
        assert_eq!(status, 200, "{h}");
        let busy = h["samples"]
            .as_array()
            .map_or(0, |a| a.iter().filter(|x| x["produced_per_s"].as_f64() > Some(0.0)).count());
        if busy >= n {
            return h;
        }
        assert!(Instant::now() < deadline, "not {n} samples with traffic after 40 s: {h}");
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Twelve messages through `work`: produced due in a second, popped, nine acked, three nacked.
fn traffic(s: &Server, round: u32) {
    // Due in a second, so that lateness is measured when they become ready; nacked once is dead.
    for i in 0..12 {
        s.produce(
            "work",
            &json!({"id": format!("w-{round}-{i}"), "body": "x", "max_attempts": 1, "delay_ms": 1_000}),
        );
    }
    let deadline = Instant::now() + NEVER_HANG;
    let mut popped = Vec::new();
    while popped.len() < 12 {
        assert!(Instant::now() < deadline, "popped only {}", popped.len());
        popped.extend(s.pop("work", 12, 2_000, None).0);
    }
    for (i, m) in popped.iter().enumerate() {
        let receipt = m["receipt"].as_str().expect("receipt");
        let (st, v) = if i < 9 {
            s.post("/v1/ack", &json!({"receipt": receipt}))
        } else {
            s.post("/v1/nack", &json!({"receipt": receipt}))
        };
        assert_eq!(st, 200, "{v}");
    }
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn the_dashboard_monitors_health_rates_lateness_and_topics() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);
    traffic(&s, 0);
    s.produce("backlog", &json!({"id": "b-1", "body": "waiting"}));
    // A push subscription to a port nothing listens on: its health says it fails.
    let hook = json!({"url": format!("http://127.0.0.1:{}/hook", closed_port()), "timeout_ms": 500});
    let (st, v) = common::answer(s.http().put(s.url("/v1/topics/hooks/push")).json(&hook).send());
    assert!(st == 200 || st == 201, "{v}");
    s.produce("hooks", &json!({"id": "h-1", "body": "ping"}));
    wait_for_busy_samples(&s, 1);
    // A second round in a later sample, so each rate is a line, not a lone point.
    traffic(&s, 1);
    let history = wait_for_busy_samples(&s, 2);
    assert_eq!(history["capacity"], 360, "{history}");
    assert_eq!(history["interval_ms"], 10_000, "{history}");

    let b = Browser::open("monitor", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    let health = b.wait_for("the health strip", HEALTH);
    assert_eq!(health["store"], "writable", "{health}");
    assert_eq!(health["version"], env!("CARGO_PKG_VERSION"), "{health}");
    assert!(
        health["uptime"].as_str().is_some_and(|t| t.contains(" s · since 20") && t.ends_with('Z')),
        "{health}"
    );
    assert!(health["disk-free"].as_str().is_some_and(|t| t.ends_with("iB") || t.ends_with(" B")), "{health}");
    assert!(health["updated"].as_str().is_some_and(|t| t.len() == 9 && t.ends_with('Z')), "{health}");

    // Every rate and lateness line is drawn; produced, delivered and acked rose above the axis.
    let drawn = b
        .js("return Array.from(document.querySelectorAll('#chart-rates polyline[data-series=\"produced\"]'))
           .map((l) => l.getAttribute('points').split(' ').length)");
    assert!(
        drawn.as_array().is_some_and(|a| a.iter().any(|n| n.as_u64() >= Some(2))),
        "no produced line: {drawn}"
    );
    let lines = b.wait_for(
        "the chart lines",
        "const base = 200 - 22;
         const o = {};
         for (const l of document.querySelectorAll('svg.chart [data-series]')) {
           const ys = l.tagName === 'circle' ? [Number(l.getAttribute('cy'))]
             : l.getAttribute('points').split(' ').map((p) => Number(p.split(',')[1]));
           o[l.dataset.series] = Math.max(o[l.dataset.series] || 0, base - Math.min(...ys));
         }
         return Object.keys(o).length >= 7 ? o : null",
    );
    for series in ["produced", "delivered", "acked", "nacked", "dead-lettered"] {
        assert!(lines[series].as_f64().is_some_and(|h| h > 0.0), "{series} stays on the axis: {lines}");
    }
    assert!(lines.get("p50").is_some() && lines.get("p99").is_some(), "{lines}");
    let ticks = b.js(
        "return Array.from(document.querySelectorAll('#chart-rates text.axis')).map((t) => t.textContent)",
    );
    assert!(
        ticks
            .as_array()
            .is_some_and(|t| t.iter().any(|x| x.as_str().is_some_and(|x| x.len() == 6 && x.ends_with('Z')))),
        "time ticks in UTC: {ticks}"
    );

    // Per topic: the oldest ready message's age, and the failing push subscription.
    let backlog = b.wait_for("backlog's oldest ready age", &topic_row("backlog"));
    assert!(backlog[5].as_str().is_some_and(|t| t.ends_with(" s") || t.ends_with(" ms")), "{backlog}");
    let hooks = b.wait_for(
        "hooks failing",
        "const c = document.querySelector('#topics tr[data-topic=\"hooks\"] [data-push=\"failing\"]');
         return c ? c.closest('td').textContent : null",
    );
    assert!(hooks.as_str().is_some_and(|t| t.contains("last error")), "{hooks}");
    assert_eq!(backlog[6], "—", "no push subscription on backlog: {backlog}");

    // No local 12-hour time anywhere: every time is UTC, though the browser's zone is not.
    assert_ne!(
        b.js("return new Date(2026, 0, 1).getTimezoneOffset()"),
        json!(0),
        "the browser runs in {BROWSER_TZ}"
    );
    let text = b.js("return document.body.innerText").as_str().unwrap_or_default().to_string();
    assert!(!text.contains(" AM") && !text.contains(" PM"), "{text}");
    b.screenshot("dashboard-monitor.png", 1280, None);
    b.screenshot("dashboard-monitor-phone.png", 390, Some(844));
    let (page_w, view_w) = (
        b.js("return document.documentElement.scrollWidth"),
        b.js("return document.documentElement.clientWidth"),
    );
    assert!(page_w.as_u64() <= view_w.as_u64(), "page is {page_w} px wide in a {view_w} px viewport");
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn messages_are_sorted_filtered_acted_on_and_linked() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);
    // Produced out of due order, on different levels.
    for (id, delay_ms) in [("d-3", 3_600_000), ("d-1", 90_000), ("d-4", 7_200_000), ("d-2", 600_000)] {
        s.produce("orders", &json!({"id": id, "body": id, "delay_ms": delay_ms}));
    }
    for i in 1..=4 {
        s.produce("orders", &json!({"id": format!("x-{i}"), "body": "fails", "max_attempts": 1}));
    }
    let (popped, _) = s.pop("orders", 4, 5_000, None);
    assert_eq!(popped.len(), 4);
    for m in &popped {
        let (st, v) = s.post("/v1/nack", &json!({"receipt": m["receipt"]}));
        assert_eq!((st, &v["state"]), (200, &json!("dead")), "{v}");
    }
    s.produce("mail", &json!({"id": "m-1", "body": "x", "delay_ms": 60_000}));
    s.produce("order-archive", &json!({"id": "a-1", "body": "x"}));

    let b = Browser::open("messages", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    b.wait_for("mail listed", &topic_row("mail"));

    // The filter keeps the matching topics and totals them.
    b.type_into("#topic-filter", "order");
    let shown = b.wait_for(
        "three topics left by the filter",
        "const r = Array.from(document.querySelectorAll('#topics tbody tr')).map((r) => r.dataset.topic);
         return r.length === 3 ? r : null",
    );
    assert_eq!(shown, json!(["order-archive", "orders", "orders.dlq"]));
    let total = b
        .js("return Array.from(document.getElementById('topics-total-row').cells).map((c) => c.textContent)");
    assert_eq!(total[0], "Total (3 of 4 topics)", "{total}");
    let (_, topics) = s.get("/v1/topics");
    let sum = |k: &str| -> u64 {
        let t = topics["topics"].as_array().expect("topics");
        t.iter().filter(|t| t["topic"] != "mail").map(|t| t[k].as_u64().expect("count")).sum()
    };
    let want =
        [sum("ready"), sum("reserved"), sum("delayed"), sum("dead_lettered")].map(|n| json!(n.to_string()));
    assert_eq!(total.as_array().expect("cells")[1..5], want, "the filtered topics summed: {total} {topics}");
    assert_eq!(want[2], "4", "{topics}");

    // Delayed messages are listed by due time, in UTC.
    b.js("document.getElementById('browse-state').value = 'delayed'");
    b.click("#topics tr[data-topic='orders'] button[aria-label='Browse orders']");
    assert_eq!(b.wait_for("the delayed messages", BROWSED_IDS), json!(["d-1", "d-2", "d-3", "d-4"]));
    let due = b.js("return Array.from(document.querySelectorAll('#messages tbody td[data-due]')).map((c) => c.textContent)");
    for t in due.as_array().expect("cells") {
        let t = t.as_str().expect("text");
        let at = t.split(" · ").nth(1).unwrap_or_default();
        assert!(at.len() == 20 && at.ends_with('Z') && at.as_bytes()[10] == b' ', "a UTC time: {t}");
    }

    // Cancel one from its row.
    b.click("#messages tr[data-id='d-2'] button[data-action='cancel']");
    b.accept_confirm();
    b.wait_for(
        "d-2 gone",
        &format!("const ids = (function () {{ {BROWSED_IDS} }})(); return ids && !ids.includes('d-2')"),
    );
    assert_eq!(s.get("/v1/messages/d-2").1["state"], "cancelled");

    // Bulk: select two, cancel both.
    b.click("#messages tr[data-id='d-3'] input.pick");
    b.click("#messages tr[data-id='d-4'] input.pick");
    assert_eq!(b.js("return document.getElementById('bulk-count').textContent"), json!("2 of 3 selected"));
    b.screenshot("dashboard-bulk-select.png", 1280, None);
    b.click("#bulk-cancel");
    b.accept_confirm();
    b.wait_for(
        "the bulk result",
        "return document.getElementById('status').textContent.startsWith('Cancel: 2 of 2')",
    );
    for id in ["d-3", "d-4"] {
        assert_eq!(s.get(&format!("/v1/messages/{id}")).1["state"], "cancelled", "{id}");
    }
    assert_eq!(s.get("/v1/messages/d-1").1["state"], "delayed");

    // Dead letters: redrive one from its row, then two selected.
    b.js("document.getElementById('browse-state').value = 'dead'");
    b.click("#topics tr[data-topic='orders'] button[aria-label='Browse orders']");
    let dead = b.wait_for(
        "four dead letters",
        &format!("const ids = (function () {{ {BROWSED_IDS} }})(); return ids && ids.length === 4 && ids.every((i) => i.startsWith('x-')) ? ids : null"),
    );
    let first = dead[0].as_str().expect("id").to_string();
    b.click(&format!("#messages tr[data-id='{first}'] button[data-action='redrive']"));
    b.wait_for(
        "the redrive of one",
        "return document.getElementById('status').textContent.startsWith('Redrive: 1 moved')",
    );
    let (_, m) = s.get(&format!("/v1/messages/{first}"));
    assert_eq!(m["topic"], "orders", "{m}");
    assert_ne!(m["state"], "dead", "{m}");
    b.wait_for(
        "three dead letters",
        &format!("const ids = (function () {{ {BROWSED_IDS} }})(); return ids && ids.length === 3"),
    );
    b.click("#select-all");
    b.wait_for(
        "all three selected",
        "return document.getElementById('bulk-count').textContent === '3 of 3 selected'",
    );
    b.click("#bulk-redrive");
    b.wait_for(
        "the bulk redrive",
        "return document.getElementById('status').textContent.startsWith('Redrive: 3 of 3 moved')",
    );
    for id in dead.as_array().expect("ids") {
        let (_, m) = s.get(&format!("/v1/messages/{}", id.as_str().expect("id")));
        assert_ne!(m["state"], "dead", "{m}");
    }

    // A link restores the view: filter, topic, state and looked-up message, none of it the token.
    b.js("document.getElementById('browse-state').value = 'delayed'");
    b.click("#topics tr[data-topic='orders'] button[aria-label='Browse orders']");
    b.wait_for(
        "d-1 listed again",
        &format!("const ids = (function () {{ {BROWSED_IDS} }})(); return ids && ids[0] === 'd-1'"),
    );
    b.click("#messages tr[data-id='d-1'] button[aria-label='Look up d-1']");
    b.wait_for(
        "d-1 looked up",
        "const e = document.getElementById('lookup-state'); return e && e.textContent === 'delayed'",
    );
    let link = b.js("return location.href").as_str().expect("href").to_string();
    assert!(
        link.contains("filter=order")
            && link.contains("topic=orders")
            && link.contains("state=delayed")
            && link.contains("message=d-1"),
        "{link}"
    );
    b.goto(&s.url("/ui"));
    b.wait_for("a fresh page", &topic_row("mail"));
    b.goto(&link);
    b.watch_errors();
    assert_eq!(b.wait_for("the linked list", BROWSED_IDS), json!(["d-1"]));
    b.wait_for(
        "the linked message",
        "const e = document.getElementById('lookup-state'); return e && e.textContent === 'delayed'",
    );
    assert_eq!(b.js("return [document.getElementById('topic-filter').value, document.getElementById('browse-state').value]"), json!(["order", "delayed"]));
    b.wait_for(
        "the linked filter applied",
        "return document.querySelectorAll('#topics tbody tr').length === 3",
    );
    b.screenshot("dashboard-shared-link.png", 1280, None);
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn deliver_now_and_reschedule_keep_the_id_and_move_the_due_time() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);
    let (_, doc) = s.get("/openapi.json");
    assert!(
        doc["paths"]["/v1/messages/{id}"].get("patch").is_some(),
        "this build has no PATCH /v1/messages/{{id}}: the dashboard's deliver now and reschedule need it"
    );
    for (id, delay_ms) in [("p-1", 3_600_000), ("p-2", 7_200_000), ("p-3", 10_800_000), ("p-4", 14_400_000)] {
        s.produce("orders", &json!({"id": id, "body": id, "delay_ms": delay_ms}));
    }
    let b = Browser::open("reschedule", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    b.wait_for("orders listed", &topic_row("orders"));
    b.js("document.getElementById('browse-state').value = 'delayed'");
    b.click("#topics tr[data-topic='orders'] button[aria-label='Browse orders']");
    assert_eq!(b.wait_for("the delayed list", BROWSED_IDS), json!(["p-1", "p-2", "p-3", "p-4"]));

    // Deliver now: the same id, ready at once.
    b.click("#messages tr[data-id='p-1'] button[data-action='deliver']");
    b.wait_for(
        "p-1 due",
        "return document.getElementById('status').textContent.startsWith('Message p-1 is due now')",
    );
    let (_, p1) = s.get("/v1/messages/p-1");
    assert_eq!((&p1["id"], &p1["state"]), (&json!("p-1"), &json!("ready")), "{p1}");

    // Reschedule by a delay, then to a UTC time: the list follows, sorted by the new due times.
    let before = common::now_ms();
    b.click("#messages tr[data-id='p-4'] button[data-action='reschedule']");
    b.rt.block_on(b.c().send_alert_text("30m")).expect("answer the prompt");
    b.accept_confirm();
    b.wait_for(
        "p-4 rescheduled",
        "return document.getElementById('status').textContent.startsWith('Message p-4 rescheduled to 20')",
    );
    let due = s.get("/v1/messages/p-4").1["deliver_at_ms"].as_u64().expect("due");
    assert!(
        due >= before + 1_800_000 && due <= common::now_ms() + 1_800_000,
        "p-4 due at {due}, asked at {before}"
    );
    let at = b.js("return new Date(Date.now() + 86400000).toISOString().slice(0, 16).replace('T', ' ')");
    let at = at.as_str().expect("a time").to_string();
    b.click("#messages tr[data-id='p-2'] button[data-action='reschedule']");
    b.rt.block_on(b.c().send_alert_text(&at)).expect("answer the prompt");
    b.accept_confirm();
    b.wait_for(
        "p-2 rescheduled",
        &format!(
            "return document.getElementById('status').textContent === 'Message p-2 rescheduled to {at}:00Z.'"
        ),
    );
    let want = b.js(&format!("return Date.parse('{}Z')", at.replace(' ', "T")));
    assert_eq!(s.get("/v1/messages/p-2").1["deliver_at_ms"], want, "p-2 at {at} UTC");
    b.wait_for(
        "the list in the new order",
        &format!(
            "const ids = (function () {{ {BROWSED_IDS} }})(); return ids && ids.join() === 'p-4,p-3,p-2'"
        ),
    );
    b.screenshot("dashboard-rescheduled.png", 1280, None);

    // Deliver two now together.
    b.click("#messages tr[data-id='p-3'] input.pick");
    b.click("#messages tr[data-id='p-2'] input.pick");
    b.click("#bulk-deliver");
    b.wait_for(
        "the bulk delivery",
        "return document.getElementById('status').textContent.startsWith('Deliver now: 2 of 2')",
    );
    for id in ["p-2", "p-3"] {
        assert_eq!(s.get(&format!("/v1/messages/{id}")).1["state"], "ready", "{id}");
    }
    assert_eq!(s.get("/v1/messages/p-4").1["state"], "delayed");
    b.assert_no_errors();
}

#[test]
#[ignore = "needs chromium and chromedriver (apt-get install chromium chromium-driver); .ci/run installs them and runs these"]
fn flow_control_is_shown_set_and_removed_from_the_topic_view() {
    let Some((driver, chrome)) = browser_tools() else { return };
    let _one = ONE_BROWSER.lock().unwrap_or_else(|p| p.into_inner());
    let s = Server::start(&[]);
    s.produce("orders", &json!({"id": "f-1", "body": "x", "delay_ms": 600_000}));
    let (st, v) = common::answer(
        s.http().put(s.url("/v1/topics/orders/flow")).json(&json!({"max_reserved": 4})).send(),
    );
    assert_eq!(st, 200, "{v}");

    let b = Browser::open("flow", &driver, &chrome);
    b.goto(&s.url("/ui"));
    b.watch_errors();
    let shown = b.wait_for(
        "the flow control of orders in its row",
        "const f = document.querySelector('#topics tr[data-topic=\"orders\"] [data-flow]');
         return f ? f.textContent : null",
    );
    assert_eq!(shown, json!("≤ 4 reserved"));

    // The row's Flow button fills the form with what is set; a rate is added and saved.
    b.click("#topics tr[data-topic='orders'] button[aria-label='Flow control of orders']");
    let form = b.js(
        "return ['flow-topic', 'flow-rate', 'flow-burst', 'flow-reserved'].map((id) => document.getElementById(id).value)",
    );
    assert_eq!(form, json!(["orders", "", "", "4"]));
    b.type_into("#flow-rate", "50");
    b.type_into("#flow-burst", "5");
    b.click("#flow-save");
    b.wait_for(
        "the new flow control in the row",
        "const f = document.querySelector('#topics tr[data-topic=\"orders\"] [data-flow]');
         return f && f.textContent === '≤ 50/s (burst 5), ≤ 4 reserved'",
    );
    let (_, v) = s.get("/v1/topics/orders/flow");
    assert_eq!(
        (v["max_per_second"].clone(), v["burst"].clone(), v["max_reserved"].clone()),
        (json!(50), json!(5), json!(4))
    );
    b.js("document.getElementById('flow').scrollIntoView({block: 'start'})");
    b.screenshot("dashboard-flow.png", 1280, Some(900));

    // A value the server refuses is said, and nothing changes.
    b.js(
        "document.getElementById('flow-burst').value = ''; document.getElementById('flow-rate').value = ''; \
          document.getElementById('flow-reserved').value = ''",
    );
    b.click("#flow-save");
    b.wait_for(
        "the refusal said",
        "const s = document.getElementById('status'); return s.classList.contains('error') && s.textContent.includes('max_per_second')",
    );
    assert_eq!(s.get("/v1/topics/orders/flow").1["max_per_second"], 50);

    b.click("#flow-clear");
    b.wait_for(
        "the row without flow control",
        "const r = document.querySelector('#topics tr[data-topic=\"orders\"]');
         return r && !r.querySelector('[data-flow]') && document.getElementById('status').textContent.includes('removed')",
    );
    assert_eq!(s.get("/v1/topics/orders/flow").0, 404);
    b.assert_no_errors();
}
