//! The variants: the bodies they send, the Envoys that serve them, the list in the order the
//! rounds alternate them, and the check that each answers before anything is measured.

use crate::envoy::{
    BenchEnvoy, EnvoyInputs, start_envoy, start_envoy_wasm, start_envoy_with, url_addr,
};
use crate::http::post_once;
use crate::keys::insert_keys;
use crate::litellm::start_litellm;
use crate::run::{Ctx, built_wasm};
use crate::streams::{json_body, stream_body};
use crate::wrk::{Load, Pair, Variant};
use crate::{CHAT_PATH, LITELLM_MASTER_KEY, SIM_CHAT_PATH, TWO_REPLICA, TWO_REPLICA_SUBJECTS, log};
use anyhow::{Context, Result, bail};
use maas_e2e::process::ManagedProcess;
use serde_json::json;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The request bodies (files for wrk's scripts).
pub(crate) struct Bodies {
    pub(crate) json: PathBuf,
    pub(crate) stream: PathBuf,
    /// Chunks of each streamed answer.
    pub(crate) stream_tokens: u32,
    /// The companion's `POST /internal/v1/authenticate` with the cached key.
    pub(crate) auth: PathBuf,
}

impl Bodies {
    pub(crate) fn write(dir: &Path, cached_key: &str) -> Result<Bodies> {
        let body_json = dir.join("chat.json");
        std::fs::write(&body_json, json_body(16))?;
        let body_stream = dir.join("chat-stream.json");
        let stream_tokens = 64;
        std::fs::write(&body_stream, stream_body(stream_tokens))?;
        let body_auth = dir.join("authenticate.json");
        std::fs::write(&body_auth, json!({"credential": cached_key}).to_string())?;
        Ok(Bodies {
            json: body_json,
            stream: body_stream,
            stream_tokens,
            auth: body_auth,
        })
    }
}

/// The Envoys the single-gateway variants run on.
pub(crate) struct Envoys {
    pub(crate) bare: BenchEnvoy,
    pub(crate) filtered: BenchEnvoy,
    /// A trivial Rust wasm filter (tests/bench/noop-filter), when built: the cost of any filter.
    pub(crate) noop: Option<BenchEnvoy>,
    pub(crate) noop_wasm: PathBuf,
    /// Other builds of the filter, measured side by side with this one (BENCH_COMPARE_WASM:
    /// `label=path,…`, e.g. `old=/tmp/old_filter.wasm`): variants `filter-cached:<label>`.
    pub(crate) compare: Vec<(&'static str, BenchEnvoy)>,
    pub(crate) compare_wasm: Vec<(&'static str, PathBuf)>,
}

impl Envoys {
    pub(crate) fn start(inputs: &EnvoyInputs<'_>, root: &Path, pool: usize) -> Result<Envoys> {
        let bare = start_envoy(inputs, "envoy-bare", false, 1000)?;
        let filtered = start_envoy(
            inputs,
            "envoy-filter",
            true,
            (pool as u64 + 1000).max(100_000),
        )?;
        let noop_wasm = built_wasm(
            root,
            "BENCH_NOOP_WASM",
            "target/bench-noop/wasm32-wasip1/release/maas_bench_noop_filter.wasm",
        );
        let noop = if noop_wasm.is_file() {
            Some(start_envoy_with(
                inputs,
                "envoy-noop",
                Some(&noop_wasm),
                1000,
            )?)
        } else {
            log(format!(
                "{} not built: no wasm-noop variant",
                noop_wasm.display()
            ));
            None
        };
        let mut compare = Vec::new();
        let mut compare_wasm: Vec<(&'static str, PathBuf)> = Vec::new();
        for item in std::env::var("BENCH_COMPARE_WASM")
            .unwrap_or_default()
            .split(',')
            .filter(|i| !i.trim().is_empty())
        {
            let (label, path) = item
                .split_once('=')
                .with_context(|| format!("BENCH_COMPARE_WASM: `{item}` is not label=path"))?;
            let envoy = start_envoy_wasm(
                inputs,
                &format!("envoy-filter-{label}"),
                Some(Path::new(path.trim())),
                true,
                (pool as u64 + 1000).max(100_000),
            )?;
            let name: &'static str =
                Box::leak(format!("filter-cached:{}", label.trim()).into_boxed_str());
            compare.push((name, envoy));
            compare_wasm.push((name, PathBuf::from(path.trim())));
        }
        Ok(Envoys {
            bare,
            filtered,
            noop,
            noop_wasm,
            compare,
            compare_wasm,
        })
    }

    /// Stops them (the memory measurements after this start fresh Envoys).
    pub(crate) fn stop(self) {
        drop(self.filtered);
        drop(self.bare);
        drop(self.noop);
        drop(self.compare);
    }
}

/// What the variants are built from.
pub(crate) struct Setup<'a> {
    pub(crate) ctx: &'a Ctx<'a>,
    pub(crate) envoys: &'a Envoys,
    /// The hostcall filter's Envoy (the wasm-floor variant), when it runs.
    pub(crate) hostcall: Option<&'a BenchEnvoy>,
    pub(crate) bodies: &'a Bodies,
    pub(crate) cached_auth: &'a str,
}

/// What runs beside the variants until the end: LiteLLM, the two-replica Envoys, the
/// filter-observed stack.
pub(crate) struct Extras {
    pub(crate) litellm: Option<ManagedProcess>,
    pub(crate) two_replica_envoys: Vec<(&'static str, Vec<BenchEnvoy>)>,
    pub(crate) observed: Option<crate::observed::Observed>,
}

/// A variant on one gateway at every concurrency.
fn variant(
    name: &'static str,
    baseline: &'static str,
    addr: SocketAddr,
    path: &str,
    body_file: &Path,
    load: Load,
    envoy_pid: u32,
) -> Variant {
    Variant {
        name,
        baseline,
        addr,
        path: path.into(),
        body_file: body_file.to_path_buf(),
        load,
        only_c: None,
        envoy_pid,
        pair: None,
    }
}

/// `post.lua` with this `Authorization` (or none).
fn fixed(auth: Option<&str>) -> Load {
    Load::Fixed {
        auth: auth.map(str::to_string),
        extra_headers: String::new(),
    }
}

/// Every variant of this run (`--only` applied), in the order the rounds alternate them.
pub(crate) fn variants(s: &Setup<'_>) -> Result<(Vec<Variant>, Extras)> {
    let mut variants = base_variants(s);
    let litellm = add_litellm(s, &mut variants)?;
    add_wasm_variants(s, &mut variants);
    let two_replica_envoys = if s.ctx.plan.two_replica {
        add_two_replica(s, &mut variants)?
    } else {
        Vec::new()
    };
    let observed = add_observed(s, &mut variants)?;
    if !s.ctx.args.only.is_empty() {
        variants.retain(|v| {
            s.ctx.args.only.iter().any(|o| {
                o == v.name
                    || (o == "filter-cached" && v.name.starts_with("filter-cached:"))
                    || (o == TWO_REPLICA && v.pair.is_some())
            })
        });
    }
    Ok((
        variants,
        Extras {
            litellm,
            two_replica_envoys,
            observed,
        },
    ))
}

fn base_variants(s: &Setup<'_>) -> Vec<Variant> {
    let (bare, filtered) = (&s.envoys.bare, &s.envoys.filtered);
    let (json, stream) = (&s.bodies.json, &s.bodies.stream);
    let auth = Some(s.cached_auth);
    let mut companion_auth = variant(
        "companion-auth",
        "-",
        s.ctx.inputs.companion_internal,
        "/internal/v1/authenticate",
        &s.bodies.auth,
        fixed(None),
        0,
    );
    companion_auth.only_c = Some(vec![32]);
    vec![
        variant(
            "direct",
            "envoy",
            s.ctx.stack.sim().addr(),
            SIM_CHAT_PATH,
            json,
            fixed(auth),
            0,
        ),
        variant(
            "envoy",
            "envoy",
            bare.listen,
            CHAT_PATH,
            json,
            fixed(auth),
            bare.pid(),
        ),
        variant(
            "filter-cached",
            "envoy",
            filtered.listen,
            CHAT_PATH,
            json,
            fixed(auth),
            filtered.pid(),
        ),
        variant(
            "envoy-stream",
            "envoy-stream",
            bare.listen,
            CHAT_PATH,
            stream,
            fixed(auth),
            bare.pid(),
        ),
        variant(
            "filter-stream",
            "envoy-stream",
            filtered.listen,
            CHAT_PATH,
            stream,
            fixed(auth),
            filtered.pid(),
        ),
        variant(
            "filter-miss",
            "envoy",
            filtered.listen,
            CHAT_PATH,
            json,
            Load::Miss,
            filtered.pid(),
        ),
        companion_auth,
    ]
}

/// filter-observed (after filter-cached), when the run includes it: its own stack.
fn add_observed(
    s: &Setup<'_>,
    variants: &mut Vec<Variant>,
) -> Result<Option<crate::observed::Observed>> {
    let name = crate::observed::FILTER_OBSERVED;
    let only = &s.ctx.args.only;
    if !only.is_empty() && !only.iter().any(|o| o == name) {
        return Ok(None);
    }
    let observed = crate::observed::start(s.ctx, crate::POLICY, crate::IDENTITIES)?;
    let v = variant(
        name,
        "envoy",
        observed.envoy.listen,
        CHAT_PATH,
        &s.bodies.json,
        fixed(Some(&observed.auth)),
        observed.envoy.pid(),
    );
    let at = variants
        .iter()
        .position(|v| v.name == "filter-cached")
        .map_or(variants.len(), |i| i + 1);
    variants.insert(at, v);
    Ok(Some(observed))
}

/// LiteLLM in front of the simulator (`--litellm`), last.
fn add_litellm(s: &Setup<'_>, variants: &mut Vec<Variant>) -> Result<Option<ManagedProcess>> {
    if !s.ctx.args.litellm {
        return Ok(None);
    }
    log("starting LiteLLM proxy (CPU 0) …");
    let (p, addr) = start_litellm(s.ctx.root, s.ctx.dir, s.ctx.stack.sim().addr())?;
    let auth = format!("Bearer {LITELLM_MASTER_KEY}");
    variants.push(variant(
        "litellm",
        "envoy",
        addr,
        "/v1/chat/completions",
        &s.bodies.json,
        fixed(Some(&auth)),
        0,
    ));
    Ok(Some(p))
}

/// wasm-noop after envoy; wasm-floor before filter-cached; the compared builds after it.
fn add_wasm_variants(s: &Setup<'_>, variants: &mut Vec<Variant>) {
    let json = &s.bodies.json;
    let auth = Some(s.cached_auth);
    if let Some(noop) = &s.envoys.noop {
        let at = variants
            .iter()
            .position(|v| v.name == "envoy")
            .map_or(0, |i| i + 1);
        variants.insert(
            at,
            variant(
                "wasm-noop",
                "envoy",
                noop.listen,
                CHAT_PATH,
                json,
                fixed(auth),
                noop.pid(),
            ),
        );
    }
    // The host calls of a cached JSON request and nothing else: the same request as
    // filter-cached's (route, body, credential), to the hostcall filter's kind `floor`.
    if let Some(floor) = s.hostcall {
        let at = variants
            .iter()
            .position(|v| v.name == "filter-cached")
            .unwrap_or(variants.len());
        let load = Load::Fixed {
            auth: Some(s.cached_auth.to_string()),
            extra_headers: "x-bench-kind: floor".into(),
        };
        variants.insert(
            at,
            variant(
                "wasm-floor",
                "envoy",
                floor.listen,
                CHAT_PATH,
                json,
                load,
                floor.pid(),
            ),
        );
    }
    for (name, envoy) in &s.envoys.compare {
        let at = variants
            .iter()
            .position(|v| v.name == "filter-cached")
            .map_or(variants.len(), |i| i + 1);
        variants.insert(
            at,
            variant(
                name,
                "envoy",
                envoy.listen,
                CHAT_PATH,
                json,
                fixed(auth),
                envoy.pid(),
            ),
        );
    }
}

/// Two gateways (each its own companion; one Redis), global limits off and on.
fn add_two_replica(
    s: &Setup<'_>,
    variants: &mut Vec<Variant>,
) -> Result<Vec<(&'static str, Vec<BenchEnvoy>)>> {
    let mut two_replica_envoys = Vec::new();
    let keys_2r = s.ctx.dir.join("two-replica-keys.txt");
    insert_keys(
        s.ctx.pg_bin,
        &s.ctx.stack.database_url(),
        TWO_REPLICA_SUBJECTS,
        &keys_2r,
        &|i| format!("bench-user-{i}"),
    )?;
    let companion_metrics = (0..2)
        .map(|i| url_addr(&s.ctx.stack.companion_metrics_url_of(i)))
        .collect::<Result<Vec<_>>>()?;
    log("starting two-replica Envoys: 2 with global limits off, 2 on (CPU 0) …");
    for (name, enabled) in [("two-replica-off", false), ("two-replica-on", true)] {
        let mut pair = Vec::with_capacity(2);
        for i in 0..2 {
            let mut global = json!({"enabled": enabled});
            if enabled {
                global["replicaId"] = json!(format!("bench-gateway-{i}"));
            }
            let inp = s.ctx.inputs.for_replica(
                url_addr(&s.ctx.stack.companion_public_url_of(i))?,
                url_addr(&s.ctx.stack.companion_internal_url_of(i))?,
                json!({"limits": {"global": global}}),
            );
            pair.push(start_envoy(&inp, &format!("envoy-{name}-{i}"), true, 1000)?);
        }
        let load = Load::Rotate {
            keys_file: keys_2r.clone(),
        };
        let mut v = variant(
            name,
            "two-replica-off",
            pair[0].listen,
            CHAT_PATH,
            &s.bodies.json,
            load,
            pair[0].pid(),
        );
        v.pair = Some(Pair {
            addr: pair[1].listen,
            envoy_pid: pair[1].pid(),
            companion_metrics: companion_metrics.clone(),
        });
        variants.push(v);
        two_replica_envoys.push((name, pair));
    }
    Ok(two_replica_envoys)
}

/// Each variant answers 200 with usage (the companion: 200) before anything is measured.
pub(crate) fn check_variants(variants: &[Variant], cached_auth: &str) -> Result<()> {
    for v in variants {
        let body = std::fs::read(&v.body_file)?;
        let auth = match &v.load {
            Load::Fixed { auth, .. } => auth.clone(),
            Load::Miss => Some(cached_auth.to_string()),
            Load::Rotate { keys_file } => {
                check_every_key(v, keys_file, &body)?;
                continue;
            }
        };
        let mut headers: Vec<(&str, &str)> = auth
            .as_deref()
            .map(|a| vec![("Authorization", a)])
            .unwrap_or_default();
        if let Load::Fixed { extra_headers, .. } = &v.load {
            headers.extend(extra_headers.split('|').filter_map(|h| {
                let (name, value) = h.split_once(':')?;
                Some((name.trim(), value.trim()))
            }));
        }
        let (status, text) = post_once(v.addr, &v.path, &headers, &body)
            .with_context(|| format!("{}: POST http://{}{}", v.name, v.addr, v.path))?;
        let ok = status == 200 && (v.name == "companion-auth" || text.contains("usage"));
        if !ok {
            bail!(
                "{}: POST {} → {status}: {}",
                v.name,
                v.path,
                text.chars().take(300).collect::<String>()
            );
        }
    }
    Ok(())
}

/// Every key of a rotating load at every gateway of the pair.
fn check_every_key(v: &Variant, keys_file: &Path, body: &[u8]) -> Result<()> {
    let addrs = std::iter::once(v.addr).chain(v.pair.as_ref().map(|p| p.addr));
    for addr in addrs {
        for key in std::fs::read_to_string(keys_file)?.lines() {
            let auth = format!("Bearer {key}");
            let (status, text) = post_once(addr, &v.path, &[("Authorization", &auth)], body)?;
            if status != 200 || !text.contains("usage") {
                bail!(
                    "{} at {addr}: POST {} → {status}: {}",
                    v.name,
                    v.path,
                    text.chars().take(300).collect::<String>()
                );
            }
        }
    }
    Ok(())
}
