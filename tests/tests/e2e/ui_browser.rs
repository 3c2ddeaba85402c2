//! The self-service web UI (issue 16) in a real browser: headless Chromium driven through
//! chromedriver (WebDriver, the `thirtyfour` crate) against the real local stack (Envoy with the
//! filter, the companion serving `ui/dist`, PostgreSQL, the model simulator).
//!
//! Alice signs in with her token, mints a key and sees it once, the key calls a model through
//! the gateway (and so does the models page's curl snippet, pasted into a shell), the usage page
//! shows those two calls once the gateway reported them to the ledger (within a report interval)
//! and the quota page the windows' real numbers, she revokes the key
//! in the UI and the gateway refuses it; Carol (admin) finds Alice's keys and bulk-revokes them.
//! Then every page again on a phone (mobile emulation, 375 px wide): none scrolls sideways and
//! every control of the navigation and of the page is on the screen and reachable by a tap.
//! Every page is saved as a PNG under `target/ui-screenshots/` (docs/ui.md shows copies).
//!
//! Needs `chromium` and `chromium-driver` (Debian; `ensure_browser` in scripts/lib/common.sh
//! installs them), Node/npm when `ui/dist` is missing or older than `ui/src` (the test builds
//! it: `npm ci && npm run build`), and the stack's programs like every e2e test.

use maas_e2e::{Stack, StackOptions, tools};
use serde_json::{Value, json};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};
use thirtyfour::prelude::*;

const WAIT: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(100);

/// `ui/dist`, built now when it is missing or older than a file of `ui/` it is built from.
fn built_ui() -> PathBuf {
    let ui = tools::workspace_root().join("ui");
    let dist = ui.join("dist");
    let built = std::fs::metadata(dist.join("index.html"))
        .and_then(|m| m.modified())
        .ok();
    let newest_source = newest_mtime(&ui.join("src"))
        .into_iter()
        .chain(
            [
                "index.html",
                "package.json",
                "package-lock.json",
                "vite.config.ts",
            ]
            .iter()
            .filter_map(|f| {
                std::fs::metadata(ui.join(f))
                    .and_then(|m| m.modified())
                    .ok()
            }),
        )
        .max();
    let fresh = matches!((built, newest_source), (Some(b), Some(s)) if b >= s);
    if !fresh {
        let npm = |args: &[&str]| {
            let status = Command::new("npm")
                .args(args)
                .current_dir(&ui)
                .status()
                .unwrap_or_else(|e| {
                    panic!("npm not found ({e}): install Node.js and npm (apt-get install nodejs npm) to build ui/")
                });
            assert!(status.success(), "npm {args:?} in ui/ failed");
        };
        if !ui.join("node_modules").is_dir() {
            npm(&["ci", "--no-audit", "--no-fund"]);
        }
        npm(&["run", "build"]);
    }
    assert!(
        dist.join("index.html").is_file(),
        "ui/dist/index.html missing after the build"
    );
    dist
}

fn newest_mtime(dir: &Path) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().and_then(|m| m.modified()).ok()
        };
        newest = newest.max(t);
    }
    newest
}

fn program(env: &str, names: &[&str]) -> PathBuf {
    if let Some(p) = std::env::var_os(env).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    names
        .iter()
        .flat_map(|n| std::env::split_paths(&path).map(move |d| d.join(n)))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{} not found (or set {env}): apt-get install chromium chromium-driver \
                 (./scripts/test.sh does, through ensure_browser in scripts/lib/common.sh)",
                names.join(" / ")
            )
        })
}

/// chromedriver on a free port, killed when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start() -> Driver {
        let bin = program("MAAS_CHROMEDRIVER", &["chromedriver"]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(&bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen on {port}"
            );
            std::thread::sleep(POLL);
        }
        Driver {
            child,
            url: format!("http://127.0.0.1:{port}"),
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The screen the browser shows the pages on.
#[derive(Clone, Copy, PartialEq)]
enum Screen {
    /// A 1280 × 900 window.
    Desktop,
    /// A phone: Chromium's mobile emulation of a `PHONE_WIDTH` × 812 CSS px touch screen, where
    /// the page's `<meta name="viewport">` applies as on a real phone.
    Phone,
}

/// The narrowest phone the UI is made for (an iPhone SE/mini in CSS pixels).
const PHONE_WIDTH: i64 = 375;

async fn browser(driver: &Driver, screen: Screen) -> WebDriver {
    let mut caps = DesiredCapabilities::chrome();
    caps.set_binary(
        program(
            "MAAS_CHROMIUM",
            &["chromium", "chromium-browser", "google-chrome"],
        )
        .to_str()
        .unwrap(),
    )
    .unwrap();
    for arg in [
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ] {
        caps.add_arg(arg).unwrap();
    }
    if screen == Screen::Phone {
        caps.add_experimental_option(
            "mobileEmulation",
            json!({"deviceMetrics": {"width": PHONE_WIDTH, "height": 812, "pixelRatio": 1.0, "touch": true}}),
        )
        .unwrap();
    }
    WebDriver::new(&driver.url, caps)
        .await
        .expect("chromium starts under chromedriver")
}

struct Shots {
    dir: PathBuf,
}

impl Shots {
    fn new() -> Shots {
        let dir = tools::workspace_root().join("target/ui-screenshots");
        std::fs::create_dir_all(&dir).unwrap();
        Shots { dir }
    }

    async fn take(&self, b: &WebDriver, name: &str) {
        let path = self.dir.join(format!("{name}.png"));
        b.screenshot(&path).await.unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{name}: not a PNG");
    }
}

async fn wait_for(b: &WebDriver, css: &str) -> WebElement {
    b.query(By::Css(css))
        .wait(WAIT, POLL)
        .first()
        .await
        .unwrap_or_else(|e| panic!("{css} never showed: {e}"))
}

async fn wait_gone(b: &WebDriver, css: &str) {
    assert!(
        b.query(By::Css(css))
            .wait(WAIT, POLL)
            .not_exists()
            .await
            .unwrap(),
        "{css} did not go away"
    );
}

async fn sign_in(b: &WebDriver, token: &str) {
    let input = wait_for(b, "#token").await;
    input.clear().await.unwrap();
    input.send_keys(token).await.unwrap();
    b.find(By::Id("sign-in"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn sign_out(b: &WebDriver) {
    b.find(By::Id("sign-out"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(b, "#token").await;
}

async fn nav(b: &WebDriver, page: &str) {
    b.find(By::Id(format!("nav-{page}")))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn chat(client: &reqwest::Client, gateway: &str, key: &str) -> (u16, String) {
    let resp = client
        .post(format!("{gateway}/llm/sim-model/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi from the ui test"}]}))
        .send()
        .await
        .expect("gateway answers");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap_or_default())
}

/// `n` as the page prints it (`toLocaleString` in en-US: 1,234).
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// How a page fits the phone's screen.
struct PhoneFit {
    page: &'static str,
    /// `document.documentElement.scrollWidth`: wider than the screen means the page scrolls
    /// sideways.
    scroll_width: i64,
    /// Each control (of the navigation and the page's own) that is not wholly on the screen or
    /// is covered by something else at its centre, as "what: why".
    unreachable: Vec<String>,
}

/// The navigation of a signed-in page: every link and sign-out.
const NAV_CONTROLS: &str = "header nav a, #sign-out";

/// Measures the page now shown on the phone: the document's width, and whether each element
/// matching `controls` lies within the screen's width (brought into view vertically only, never
/// sideways) and is what a tap at its centre reaches. Saves a screenshot as `shot`.
async fn phone_fit(
    b: &WebDriver,
    shots: &Shots,
    page: &'static str,
    shot: &str,
    controls: &str,
) -> PhoneFit {
    let measured = b
        .execute(
            r#"
            const [selector] = arguments;
            const screen = document.documentElement.clientWidth;
            const unreachable = [];
            const elements = [...document.querySelectorAll(selector)];
            for (const el of elements) {
                const name = el.id ? `#${el.id}` : `${el.tagName.toLowerCase()} "${el.textContent.trim().slice(0, 30)}"`;
                const before = el.getBoundingClientRect();
                window.scrollTo(0, window.scrollY + before.top - Math.max(0, (window.innerHeight - before.height) / 2));
                const r = el.getBoundingClientRect();
                if (r.width === 0 || r.height === 0) {
                    unreachable.push(`${name}: not shown`);
                    continue;
                }
                if (r.left < 0 || r.right > screen + 0.5) {
                    unreachable.push(`${name}: spans x ${Math.round(r.left)}..${Math.round(r.right)}, the screen 0..${screen}`);
                    continue;
                }
                const y = Math.min(Math.max(r.top + r.height / 2, 0), window.innerHeight - 1);
                const hit = document.elementFromPoint(r.left + r.width / 2, y);
                if (!hit || !(hit === el || el.contains(hit))) {
                    unreachable.push(`${name}: covered by ${hit ? hit.outerHTML.slice(0, 60) : 'nothing'}`);
                }
            }
            window.scrollTo(0, 0);
            return [document.documentElement.scrollWidth, screen, elements.length, unreachable];
            "#,
            vec![json!(controls)],
        )
        .await
        .unwrap();
    let (scroll_width, screen, found, unreachable): (i64, i64, usize, Vec<String>) =
        serde_json::from_value(measured.json().clone()).unwrap();
    assert_eq!(
        screen, PHONE_WIDTH,
        "{page}: the phone emulation's screen is {screen} px wide"
    );
    assert!(found > 0, "{page}: nothing matches {controls:?}");
    eprintln!(
        "ui figure: phone {PHONE_WIDTH} px: {page}: document scrollWidth {scroll_width} px, \
         {found} controls checked, {} unreachable",
        unreachable.len()
    );
    shots.take(b, shot).await;
    PhoneFit {
        page,
        scroll_width,
        unreachable,
    }
}

/// On the desktop window: the page is no wider than the window, and a key table shown is a table
/// with its header row (the phones' one card per key stays on phones).
async fn assert_desktop_layout(b: &WebDriver, page: &str) {
    let measured = b
        .execute(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth,
                     [...document.querySelectorAll('table.keys thead')].map(t => getComputedStyle(t).display)];",
            vec![],
        )
        .await
        .unwrap();
    let (scroll_width, window, key_table_heads): (i64, i64, Vec<String>) =
        serde_json::from_value(measured.json().clone()).unwrap();
    assert!(
        window >= 1000,
        "{page}: the desktop window is {window} px wide"
    );
    assert!(
        scroll_width <= window,
        "{page}: {scroll_width} px wide in a {window} px window"
    );
    assert!(
        key_table_heads.iter().all(|d| d == "table-header-group"),
        "{page}: the key table's header row is {key_table_heads:?}"
    );
}

/// The first row of the key table for `name`.
/// On the admin page: everyone's spend by organisation from the real ledger (Alice's calls ran
/// on a tier: no organisation, no cost), then the documented shape with money (the page's fetch
/// answers it): largest spender first, the total added exactly.
async fn carol_sees_spend_by_organisation(b: &WebDriver, shots: &Shots) {
    wait_for(b, "#spend-load").await.click().await.unwrap();
    let table = wait_for(b, "#spend-table").await.text().await.unwrap();
    assert!(table.contains("(none)"), "{table}");
    b.execute(
        r#"
        const real = window.fetch;
        window.fetch = (url, init) => String(url).includes('groupBy=organization')
            ? Promise.resolve(new Response(JSON.stringify({data: [
                {organization: 'org-small', requests: 3, promptTokens: 30, completionTokens: 20, cost: '0.0042'},
                {organization: 'org-big', requests: 9, promptTokens: 900, completionTokens: 600, cost: '0.006'}]}),
                {status: 200, headers: {'content-type': 'application/json'}}))
            : real(url, init);
        "#,
        vec![],
    )
    .await
    .unwrap();
    b.find(By::Id("spend-load"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let card = wait_for(b, "#spend-table").await.text().await.unwrap();
        if card.contains("org-big") {
            let big = card.find("org-big").unwrap();
            let small = card.find("org-small").unwrap();
            assert!(big < small, "largest spender first: {card}");
            break;
        }
        assert!(Instant::now() < deadline, "{card}");
        tokio::time::sleep(POLL).await;
    }
    let main = b.find(By::Tag("main")).await.unwrap().text().await.unwrap();
    assert!(main.contains("Spend by organisation: 0.0102"), "{main}");
    let bars = b
        .find_all(By::Css("#spend-by-group-chart .bar"))
        .await
        .unwrap();
    assert_eq!(bars.len(), 2);
    shots.take(b, "09b-admin-spend-by-organisation").await;
    assert_desktop_layout(b, "09b-admin-spend-by-organisation").await;
}

fn row(name: &str) -> String {
    format!("tr[data-key-name='{name}']")
}

/// The text of key `name`'s cell of class `class` in the keys table.
async fn key_cell(b: &WebDriver, name: &str, class: &str) -> String {
    wait_for(b, &format!("{} td.{class}", row(name)))
        .await
        .text()
        .await
        .unwrap()
}

#[tokio::test]
// One scenario read top to bottom (its steps share the stack state they build): over 100 lines.
#[allow(clippy::too_many_lines)]
async fn alice_mints_uses_and_revokes_a_key_in_the_browser_and_carol_finds_her_keys() {
    let dist = built_ui();
    let mut options = StackOptions::default();
    options
        .companion_env
        .push(("MAAS_UI_DIR".into(), dist.display().to_string()));
    let stack = tokio::task::spawn_blocking(move || Stack::start(options))
        .await
        .expect("stack start task")
        .expect("stack starts");
    let gw = stack.gateway_url();
    let ui = format!("{gw}/maas-api/ui/");
    let client = stack.client();

    // Served through the gateway with the headers the page relies on.
    let resp = client.get(&ui).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let csp = resp.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let index = resp.text().await.unwrap();
    assert!(
        !index.contains("<script>"),
        "no inline script: the CSP would block it"
    );
    let script = index
        .split("src=\"./")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("index.html loads a script");
    let asset = client.get(format!("{ui}{script}")).send().await.unwrap();
    assert_eq!(asset.status(), 200, "{script}");
    assert!(
        asset.headers()["content-type"]
            .to_str()
            .unwrap()
            .contains("javascript")
    );
    assert!(
        asset.headers()["cache-control"]
            .to_str()
            .unwrap()
            .contains("immutable")
    );

    let driver = Driver::start();
    let b = browser(&driver, Screen::Desktop).await;
    let shots = Shots::new();

    // A refused token: the API's own message is shown.
    b.goto(&ui).await.unwrap();
    shots.take(&b, "01-sign-in").await;
    sign_in(&b, "not-a-token").await;
    let refused: Value = client
        .get(format!("{gw}/maas-api/v1/tiers"))
        .bearer_auth("not-a-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let api_message = refused["error"]["message"].as_str().unwrap().to_string();
    let shown = wait_for(&b, ".error").await.text().await.unwrap();
    assert!(
        shown.contains(&api_message),
        "shown {shown:?}, the API said {api_message:?}"
    );
    shots.take(&b, "01b-sign-in-refused").await;

    // Alice signs in; the token is in sessionStorage only.
    sign_in(&b, "alice-token").await;
    assert_eq!(
        wait_for(&b, "#current-tier").await.text().await.unwrap(),
        "Free"
    );
    let storage = b
        .execute(
            "return [sessionStorage.getItem('maas.token'), localStorage.length, document.cookie];",
            vec![],
        )
        .await
        .unwrap();
    assert_eq!(storage.json(), &json!(["alice-token", 0, ""]));

    // Mint two keys: each is shown once.
    let mut browser_key = String::new();
    for name in ["browser-key", "second-key"] {
        let input = wait_for(&b, "#mint-name").await;
        input.send_keys(name).await.unwrap();
        if name == "second-key" {
            // The second with limits of its own (per-key limits at mint).
            wait_for(&b, "#mint-requests-per-day")
                .await
                .send_keys("50")
                .await
                .unwrap();
            wait_for(&b, "#mint-tokens-per-day")
                .await
                .send_keys("20,000")
                .await
                .unwrap();
        }
        b.find(By::Id("mint")).await.unwrap().click().await.unwrap();
        wait_for(&b, &row(name)).await;
        let shown = wait_for(&b, "#new-key").await.text().await.unwrap();
        assert!(shown.starts_with("sk-oai-"), "{shown}");
        if name == "browser-key" {
            shots.take(&b, "02-key-shown-once").await;
            browser_key = shown;
        }
        b.find(By::Id("new-key-done"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        wait_gone(&b, "#new-key").await;
    }
    // The local policy gives alice no subscription: the mint form has no subscription select
    // (it appears with one, below) and her keys show none.
    let subs: Value = client
        .get(format!("{gw}/maas-api/v1/subscriptions"))
        .bearer_auth("alice-token")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        subs,
        json!([]),
        "alice has no subscription in the local policy"
    );
    assert!(
        b.find_all(By::Id("mint-subscription"))
            .await
            .unwrap()
            .is_empty(),
        "no subscription select without subscriptions"
    );
    assert_eq!(key_cell(&b, "browser-key", "subscription").await, "—");
    // The key's own limits are listed with it (and were stored: the API shows them).
    assert_eq!(
        key_cell(&b, "second-key", "limits").await,
        "50 requests / 1d · 20,000 tokens / 1d"
    );
    assert_eq!(key_cell(&b, "browser-key", "limits").await, "—");
    let listed: Value = client
        .post(format!("{gw}/maas-api/v1/api-keys/search"))
        .bearer_auth("alice-token")
        .json(&json!({"filters": {"status": ["active"]}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let second = listed["data"]
        .as_array()
        .and_then(|keys| keys.iter().find(|k| k["name"] == "second-key"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        second["limits"],
        json!({"requests": [{"limit": 50, "window": "1d"}],
               "tokens": [{"limit": 20000, "window": "1d"}]}),
        "{listed}"
    );
    // Never again, not even after a reload.
    b.refresh().await.unwrap();
    wait_for(&b, &row("browser-key")).await;
    assert!(!b.source().await.unwrap().contains(&browser_key));
    shots.take(&b, "03-keys").await;
    assert_desktop_layout(&b, "03-keys").await;

    // Search narrows the list.
    let search = wait_for(&b, "#key-search").await;
    search.send_keys("second").await.unwrap();
    wait_gone(&b, &row("browser-key")).await;
    wait_for(&b, &row("second-key")).await;
    search.clear().await.unwrap();
    search.send_keys("key").await.unwrap();
    wait_for(&b, &row("browser-key")).await;

    // The key calls a model through the gateway.
    let (status, body) = chat(&client, &gw, &browser_key).await;
    assert_eq!(status, 200, "{body}");
    let first: Value = serde_json::from_str(&body).unwrap();

    // The models page's curl snippet, pasted into a shell with the key, works too.
    nav(&b, "models").await;
    let model = wait_for(&b, "[data-model='sim-model']").await;
    let snippets = model.find_all(By::Css("pre")).await.unwrap();
    assert_eq!(snippets.len(), 2, "curl and Python");
    // The snippets use the one base URL, the model named in the body; the model's own URL is
    // shown beside them.
    let curl = snippets[0].text().await.unwrap();
    assert!(
        curl.contains(&format!("{gw}/v1/chat/completions"))
            && curl.contains("\"model\":\"sim-model\""),
        "{curl}"
    );
    let python = snippets[1].text().await.unwrap();
    assert!(
        python.contains(&format!("base_url=\"{gw}/v1\"")),
        "{python}"
    );
    let one_url = wait_for(&b, "#one-base-url code")
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(one_url, format!("{gw}/v1"));
    let own = model
        .find(By::Css(".model-url"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(own.ends_with("/llm/sim-model/v1"), "{own}");
    // The readiness badge says what the model list says (the probe of the model's server).
    let listed = crate::helpers::send(
        client
            .get(format!("{gw}/maas-api/v1/models"))
            .bearer_auth(&browser_key),
    )
    .await;
    let ready = serde_json::from_str::<Value>(&listed.body).unwrap()["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "sim-model")
        .map(|m| m["ready"] == true)
        .unwrap();
    let badge = model
        .find(By::Css(".model-ready"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(badge, if ready { "ready" } else { "not ready" });
    shots.take(&b, "04-models").await;
    assert_desktop_layout(&b, "04-models").await;
    let out = Command::new("bash")
        .arg("-c")
        .arg(&curl)
        .env("MAAS_API_KEY", &browser_key)
        .output()
        .expect("bash runs the snippet");
    let answer: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("snippet output not JSON ({e}): {out:?}"));
    assert_eq!(answer["object"], "chat.completion", "{answer}");

    // Usage: the gateway reports the two calls to the ledger within its report interval
    // (`usage.reportIntervalMs`, 5 s by default): reload until the day's row of sim-model shows
    // exactly them — the simulator's usage numbers.
    let tokens = |v: &Value, name: &str| v["usage"][name].as_u64().unwrap();
    let (prompt, completion) = (
        tokens(&first, "prompt_tokens") + tokens(&answer, "prompt_tokens"),
        tokens(&first, "completion_tokens") + tokens(&answer, "completion_tokens"),
    );
    let want = format!(
        "sim-model 2 {} {} {}",
        grouped(prompt),
        grouped(completion),
        grouped(prompt + completion)
    );
    nav(&b, "usage").await;
    let deadline = Instant::now() + WAIT;
    let reported = Instant::now();
    loop {
        b.goto(format!("{ui}usage")).await.unwrap();
        wait_for(&b, "#usage-table, #usage-empty, .error").await;
        let page = b.find(By::Tag("main")).await.unwrap().text().await.unwrap();
        if page.contains(&want) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "usage never showed {want:?}: {page}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "ui figure: the usage page showed the calls {} ms after the check began",
        reported.elapsed().as_millis()
    );
    assert_eq!(
        b.find_all(By::Css("#usage-chart .bar"))
            .await
            .unwrap()
            .len(),
        1,
        "one bar: today"
    );
    shots.take(&b, "05-usage").await;
    // Quota: alice's free tier's windows with the real counters (`used` is what the gateway
    // enforces against: leased budget included, so at least the two calls while in the window).
    nav(&b, "quota").await;
    wait_for(&b, "#tier-limits").await;
    let quota = wait_for(&b, "#quota-table").await.text().await.unwrap();
    for limit in ["30 requests 1m", "2,000 tokens 1m", "100,000 tokens 1d"] {
        assert!(quota.contains(limit), "{limit:?} not in {quota}");
    }
    let daily_used: u64 = quota
        .lines()
        .find(|l| l.starts_with("100,000 tokens 1d"))
        .and_then(|l| l.split_whitespace().nth(3))
        .map(|n| n.replace(',', "").parse().unwrap())
        .unwrap();
    assert!(
        daily_used >= prompt + completion,
        "the day's tokens used {daily_used} < the calls' {}",
        prompt + completion
    );
    shots.take(&b, "06-quota").await;

    // The two pages render the ledger's documented shapes once it is served: the page's fetch
    // answers them here (no reload: the app keeps its state), with no CSP violation.
    b.execute(
        r#"
        window.__csp = [];
        document.addEventListener('securitypolicyviolation', e => window.__csp.push(e.violatedDirective));
        const real = window.fetch;
        const answer = body => Promise.resolve(new Response(JSON.stringify(body),
            {status: 200, headers: {'content-type': 'application/json'}}));
        window.fetch = (url, init) => {
            const u = String(url);
            if (u.includes('/v1/usage?')) return answer({data: [
                {day: '2026-11-30', model: 'sim-model', promptTokens: 1200, completionTokens: 800, requests: 9,
                 refused: {rate_limit_exceeded: 2, tokens_exceed_limit: 1}, cachedInputTokens: 500,
                 cost: '0.004'},
                {day: '2026-12-01', model: 'sim-model', promptTokens: 300, completionTokens: 200, requests: 3},
                {day: '2026-12-01', model: 'sim-premium', promptTokens: 40, completionTokens: 60, requests: 1,
                 refused: {}, cachedInputTokens: 0, cost: '0.0002'}]});
            if (u.endsWith('/v1/quota')) return answer({data: [
                {kind: 'tokens', window: '1m', limit: 2000, used: 1700, remaining: 300, resetsAt: '2026-12-01T05:01:00Z',
                 percentUsed: 85, warning: 80, burnRatePerHour: 102000, projectedExhaustionAt: '2026-12-01T05:00:50Z'},
                {kind: 'requests', window: '1m', limit: 30, used: 4, remaining: 26, resetsAt: '2026-12-01T05:01:00Z'},
                {kind: 'cost', window: '1d', limit: 50000000, used: 48300000, remaining: 1700000,
                 resetsAt: '2026-12-02T00:00:00Z', percentUsed: 96, warning: 95,
                 amounts: {limit: '0.05', used: '0.0483', remaining: '0.0017', burnRatePerHour: '0.01'}}]});
            if (u.endsWith('/v1/subscriptions')) return answer([
                {subscription_id_header: 'team-a', display_name: 'Team A', priority: 1,
                 model_refs: [{name: 'sim-model', namespace: 'llm'}]}]);
            return real(url, init);
        };
        "#,
        vec![],
    )
    .await
    .unwrap();
    nav(&b, "keys").await;
    // With a subscription, the mint form offers it (and "default", which omits the field).
    let select = wait_for(&b, "#mint-subscription").await;
    let options = select.text().await.unwrap();
    assert!(
        options.contains("default") && options.contains("Team A"),
        "{options}"
    );
    shots.take(&b, "03b-keys-with-subscription").await;
    nav(&b, "usage").await;
    let table = wait_for(&b, "#usage-table").await.text().await.unwrap();
    // Requests, prompt, completion, total, refused (all reasons), cached input tokens, cost.
    for want in [
        "2026-11-30 sim-model 9 1,200 800 2,000 3 500 0.004",
        "2026-12-01 sim-premium 1 40 60 100 0 0 0.0002",
    ] {
        assert!(table.contains(want), "{want:?} not in {table}");
    }
    // Tokens and spend per day, split by model (a legend names the two): exact decimal totals.
    let spend = wait_for(&b, "#spend-chart").await.text().await.unwrap();
    assert!(
        spend.contains("sim-model") && spend.contains("sim-premium"),
        "{spend}"
    );
    let mut per_day = Vec::new();
    for value in b
        .find_all(By::Css("#spend-chart .bar-value"))
        .await
        .unwrap()
    {
        per_day.push(value.text().await.unwrap());
    }
    assert_eq!(per_day, ["0.004", "0.0002"], "{spend}");
    let segments = b.find_all(By::Css("#usage-chart .bar .seg")).await.unwrap();
    assert_eq!(
        segments.len(),
        3,
        "one segment per day and model with tokens"
    );
    let reasons = wait_for(&b, "#usage-table td.refused")
        .await
        .attr("title")
        .await
        .unwrap();
    assert_eq!(
        reasons.as_deref(),
        Some("rate_limit_exceeded: 2, tokens_exceed_limit: 1"),
        "the refused count's tooltip names its reasons"
    );
    let bars = b.find_all(By::Css("#usage-chart .bar")).await.unwrap();
    assert_eq!(bars.len(), 2, "one bar per day");
    shots.take(&b, "05b-usage-with-data").await;
    assert_desktop_layout(&b, "05b-usage-with-data").await;
    nav(&b, "quota").await;
    let quota = wait_for(&b, "#quota-table").await.text().await.unwrap();
    assert!(quota.contains("2,000 tokens 1m 1,700 300"), "{quota}");
    // A money budget in its exact decimals, not in nano-units.
    assert!(quota.contains("0.05 spend 1d 0.0483 0.0017"), "{quota}");
    assert!(!quota.contains("50,000,000"), "{quota}");
    // The early warning, with when the window runs out at this rate.
    assert!(quota.contains("past 80% · runs out"), "{quota}");
    let warned = b
        .find_all(By::Css("#quota-table td.warning"))
        .await
        .unwrap();
    assert_eq!(warned.len(), 2, "the tokens window and the budget warn");
    shots.take(&b, "06b-quota-with-data").await;
    assert_desktop_layout(&b, "06b-quota-with-data").await;
    let violations = b.execute("return window.__csp;", vec![]).await.unwrap();
    assert_eq!(violations.json(), &json!([]), "CSP violations");

    // A client route loads directly (the companion answers index.html for it).
    b.goto(format!("{ui}keys")).await.unwrap();
    let revoke = wait_for(&b, &format!("{} .revoke", row("browser-key"))).await;
    revoke.click().await.unwrap();
    wait_for(&b, &format!("{} .revoke-confirm", row("browser-key")))
        .await
        .click()
        .await
        .unwrap();
    wait_gone(&b, &row("browser-key")).await;
    shots.take(&b, "07-key-revoked").await;

    // The gateway refuses the revoked key.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, body) = chat(&client, &gw, &browser_key).await;
        if status == 401 {
            let v: Value = serde_json::from_str(&body).unwrap();
            assert!(v["error"]["message"].is_string(), "{body}");
            break;
        }
        assert_eq!(status, 200, "{body}");
        assert!(Instant::now() < deadline, "the revoked key still works");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Alice is not an admin: the admin page shows the API's refusal.
    nav(&b, "admin").await;
    wait_for(&b, "#admin-username")
        .await
        .send_keys("bob")
        .await
        .unwrap();
    b.find(By::Id("admin-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let refusal = wait_for(&b, ".error").await.text().await.unwrap();
    assert!(refusal.contains("403"), "{refusal}");

    // Carol (admin) finds Alice's keys, revoked one included, and revokes the rest at once.
    sign_out(&b).await;
    sign_in(&b, "carol-token").await;
    wait_for(&b, "#current-tier").await;
    nav(&b, "admin").await;
    wait_for(&b, "#admin-username")
        .await
        .send_keys("alice")
        .await
        .unwrap();
    b.find(By::Id("admin-active-only"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    b.find(By::Id("admin-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let revoked_row = wait_for(&b, &row("browser-key"))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        revoked_row.contains("alice") && revoked_row.contains("revoked"),
        "{revoked_row}"
    );
    wait_for(&b, &row("second-key")).await;
    shots.take(&b, "08-admin-keys-by-user").await;
    assert_desktop_layout(&b, "08-admin-keys-by-user").await;
    wait_for(&b, "#bulk-revoke").await.click().await.unwrap();
    wait_for(&b, "#bulk-revoke-confirm")
        .await
        .click()
        .await
        .unwrap();
    let notice = wait_for(&b, "#admin-notice").await.text().await.unwrap();
    assert!(notice.contains('1'), "{notice}");
    let deadline = Instant::now() + WAIT;
    while !wait_for(&b, &row("second-key"))
        .await
        .text()
        .await
        .unwrap_or_default()
        .contains("revoked")
    {
        assert!(Instant::now() < deadline, "second-key not shown revoked");
        tokio::time::sleep(POLL).await;
    }
    shots.take(&b, "09-admin-bulk-revoked").await;
    carol_sees_spend_by_organisation(&b, &shots).await;
    let left: Value = client
        .post(format!("{gw}/maas-api/v1/api-keys/search"))
        .bearer_auth("alice-token")
        .json(&json!({"filters": {"status": ["active"]}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(left["data"], json!([]), "{left}");

    b.quit().await.unwrap();

    // Every page on a phone: no sideways scrolling of the page (long keys, snippets and tables
    // scroll inside their own box), every control of the navigation and of the page on the
    // screen and reachable by a tap. Alice again (her usage is in the ledger by now), then Carol
    // on the admin page with Alice's keys listed.
    let b = browser(&driver, Screen::Phone).await;
    let mut fits = Vec::new();
    b.goto(&ui).await.unwrap();
    wait_for(&b, "#token").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "sign-in",
            "10-phone-sign-in",
            "#token, #sign-in",
        )
        .await,
    );
    sign_in(&b, "not-a-token").await;
    wait_for(&b, ".error").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "sign-in refused",
            "10b-phone-sign-in-refused",
            "#token, #sign-in, .error",
        )
        .await,
    );
    sign_in(&b, "alice-token").await;
    wait_for(&b, "#current-tier").await;
    wait_for(&b, "#mint-name")
        .await
        .send_keys("phone-key")
        .await
        .unwrap();
    b.find(By::Id("mint")).await.unwrap().click().await.unwrap();
    wait_for(&b, "#new-key").await;
    wait_for(&b, &row("phone-key")).await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "new key shown once",
            "11-phone-key-shown-once",
            &format!("{NAV_CONTROLS}, #new-key, #copy-new-key, #new-key-done"),
        )
        .await,
    );
    b.find(By::Id("new-key-done"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_gone(&b, "#new-key").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "keys",
            "12-phone-keys",
            &format!(
                "{NAV_CONTROLS}, #mint-name, #mint-expiry, #mint-tier, #mint, #key-search, \
                 {} .revoke",
                row("phone-key")
            ),
        )
        .await,
    );
    // The two-step revoke works by tap too (cancelled: Carol finds the key active below).
    wait_for(&b, &format!("{} .revoke", row("phone-key")))
        .await
        .click()
        .await
        .unwrap();
    wait_for(&b, &format!("{} .revoke-confirm", row("phone-key"))).await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "keys: confirm revoke",
            "12b-phone-keys-confirm-revoke",
            &format!("{0} .revoke-confirm, {0} .link", row("phone-key")),
        )
        .await,
    );
    b.find(By::Css(format!("{} .link", row("phone-key"))))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&b, &format!("{} .revoke", row("phone-key"))).await;
    nav(&b, "models").await;
    wait_for(&b, "[data-model='sim-model'] pre").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "models",
            "13-phone-models",
            &format!("{NAV_CONTROLS}, .model-url, .snippet, .snippet .copy"),
        )
        .await,
    );
    nav(&b, "usage").await;
    wait_for(&b, "#usage-table").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "usage",
            "14-phone-usage",
            &format!("{NAV_CONTROLS}, #usage-from, #usage-to, #usage-chart, .table-scroll"),
        )
        .await,
    );
    nav(&b, "quota").await;
    wait_for(&b, "#quota-table").await;
    wait_for(&b, "#tier-limits").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "quota",
            "15-phone-quota",
            &format!("{NAV_CONTROLS}, .table-scroll, #tier-limits"),
        )
        .await,
    );
    nav(&b, "admin").await;
    wait_for(&b, "#admin-username")
        .await
        .send_keys("bob")
        .await
        .unwrap();
    b.find(By::Id("admin-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&b, ".error").await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "admin refused",
            "16-phone-admin-refused",
            &format!("{NAV_CONTROLS}, #admin-username, #admin-active-only, #admin-search, .error"),
        )
        .await,
    );
    sign_out(&b).await;
    sign_in(&b, "carol-token").await;
    wait_for(&b, "#current-tier").await;
    nav(&b, "admin").await;
    wait_for(&b, "#admin-username")
        .await
        .send_keys("alice")
        .await
        .unwrap();
    b.find(By::Id("admin-active-only"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    b.find(By::Id("admin-search"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_for(&b, &row("browser-key")).await;
    wait_for(&b, &row("phone-key")).await;
    fits.push(
        phone_fit(
            &b,
            &shots,
            "admin: keys of a user",
            "17-phone-admin-keys-by-user",
            &format!(
                "{NAV_CONTROLS}, #admin-username, #admin-search, #bulk-revoke, {} .revoke",
                row("phone-key")
            ),
        )
        .await,
    );
    b.quit().await.unwrap();
    let misfits: Vec<String> = fits
        .iter()
        .filter(|f| f.scroll_width > PHONE_WIDTH || !f.unreachable.is_empty())
        .map(|f| {
            format!(
                "{}: {} px wide; {:?}",
                f.page, f.scroll_width, f.unreachable
            )
        })
        .collect();
    assert!(
        misfits.is_empty(),
        "pages that do not fit a {PHONE_WIDTH} px phone:\n{}",
        misfits.join("\n")
    );

    drop(driver);
    stack.shutdown();
}
