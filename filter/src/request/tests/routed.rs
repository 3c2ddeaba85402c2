//! Routed backends (a model whose backends name their own clusters: the reference's weighted
//! `externalProviderRefs`): the backend drawn per request by weight among those that can serve,
//! routed by the routing headers, and given everything a single provider gets.

use super::*;
use crate::ledger::RecordKey;
use maas_types::usage::hour_start_of;

fn routed_policy(weights: [u32; 2]) -> Value {
    let mut p = policy();
    p["tiers"][0]["limits"] = json!({"requests": [{"limit": 1000, "window": "1m"}],
                                     "tokens": [{"limit": 1000000, "window": "1m"}]});
    p["models"] = json!([
        {"name": "duo", "path": "/ext/duo", "tiers": ["free"], "api": "openai",
         "backends": [
            {"name": "oai", "upstreamCluster": "c-oai", "servedName": "gpt-4o",
             "weight": weights[0], "provider": {"type": "openai", "credentialRef": "k"}},
            {"name": "az", "upstreamCluster": "c-az", "weight": weights[1],
             "provider": {"type": "azure-openai", "credentialRef": "k2", "deployment": "d1",
                          "apiVersion": "2024-10-21"}}
         ]}
    ]);
    p
}

fn fx(weights: [u32; 2], credentials: &[(&str, &str)]) -> Fx {
    let fx =
        Fx::with(json!({"pauseHeadersForBody": true, "bootstrapPolicy": routed_policy(weights)}));
    fx.cache(&key(2), allow_alice());
    fx.root.worker.borrow_mut().credentials = Rc::new(CredentialsDocument {
        credentials: credentials
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    });
    fx
}

fn request(path: &str) -> Vec<(&'static str, String)> {
    vec![
        (":method", "POST".into()),
        (":path", path.into()),
        ("authorization", format!("Bearer {}", key(2))),
        ("content-type", "application/json".into()),
        // A client's own copy of the backend header never routes anything.
        ("x-maas-backend", "az".into()),
    ]
}

/// What left for one request: the backend header, `:path`, the two credential headers and
/// the body's `model`; the request id and its handle for the response.
struct Left {
    id: u32,
    h: Http,
    backend: Option<String>,
    path: Option<String>,
    authorization: Option<String>,
    api_key: Option<String>,
    model: Option<String>,
}

fn send(fx: &Fx, path: &str) -> Result<Left, (u32, String)> {
    let (id, h) = fx.http();
    fx.headers(id, &h, &refs(&request(path)), false);
    fx.body(
        id,
        &h,
        br#"{"model":"duo","messages":[{"role":"user","content":"hi"}]}"#,
        true,
    );
    if let Some(s) = fx.sent_to(id) {
        return Err((s.status, s.code()));
    }
    let v = |n: &str| fx.host.map_value(Headers::Request, n);
    let body: Value = serde_json::from_slice(&fx.host.buffer(Body::Request)).unwrap_or(Value::Null);
    assert_eq!(v("x-maas-model").as_deref(), Some("duo"));
    Ok(Left {
        id,
        h,
        backend: v("x-maas-backend"),
        path: v(":path"),
        authorization: v("authorization"),
        api_key: v("api-key"),
        model: body["model"].as_str().map(str::to_string),
    })
}

/// The answer from `cluster` (what Envoy routed to): passed on, or refused.
fn answer(fx: &Fx, left: &Left, cluster: &str) -> Action {
    fx.host
        .properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), cluster.into());
    fx.host.enter(left.id);
    fx.host.set_map(
        Headers::Response,
        &[(":status", "200"), ("content-type", "application/json")],
    );
    let a = left.h.on_response_headers(&fx.host);
    if a == Action::Continue {
        let body = br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}"#;
        fx.host.set_buffer(Body::Response, body);
        left.h.on_response_body(&fx.host, body.len(), true);
    }
    fx.host.enter(left.id);
    left.h.on_log(&fx.host);
    left.h.on_done(&fx.host);
    a
}

#[test]
fn each_request_gets_the_drawn_backends_credential_path_and_name_at_both_urls() {
    let fx = fx([1, 1], &[("k", "sk-oai"), ("k2", "sk-az")]);
    let mut seen = std::collections::BTreeMap::new();
    for i in 0..60 {
        let path = if i % 2 == 0 {
            "/ext/duo/v1/chat/completions"
        } else {
            "/v1/chat/completions"
        };
        let left = send(&fx, path).unwrap();
        let backend = left.backend.clone().expect("the backend header is set");
        match backend.as_str() {
            "oai" => {
                assert_eq!(left.authorization.as_deref(), Some("Bearer sk-oai"));
                assert_eq!(left.api_key, None);
                assert_eq!(left.model.as_deref(), Some("gpt-4o"));
                // The path as sent (the route rewrites the prefix).
                assert_eq!(left.path.as_deref(), Some(path));
                assert_eq!(answer(&fx, &left, "c-oai"), Action::Continue);
            }
            "az" => {
                assert_eq!(left.api_key.as_deref(), Some("sk-az"));
                assert_eq!(left.authorization, None);
                assert_eq!(
                    left.path.as_deref(),
                    Some("/openai/deployments/d1/chat/completions?api-version=2024-10-21")
                );
                assert_eq!(left.model.as_deref(), Some("duo"));
                assert_eq!(answer(&fx, &left, "c-az"), Action::Continue);
            }
            other => panic!("backend {other:?}"),
        }
        *seen.entry(backend).or_insert(0) += 1;
    }
    // Both drawn (1:1 over 60: each at least 15 unless the draw is broken).
    assert!(seen.values().all(|n| *n >= 15), "{seen:?}");
    // The ledger names the backend that served, under the model's one name.
    let key = |backend: &str| RecordKey {
        subject: "alice".into(),
        key_id: credential::extract(None, Some(&key(2)))
            .unwrap()
            .cache_identity()
            .key_id()
            .map(str::to_string),
        tier: "free".into(),
        model: "duo".into(),
        backend: Some(backend.into()),
        hour_start: hour_start_of(fx.host.now.get() / 1000),
    };
    let w = fx.root.worker.borrow();
    for (b, n) in &seen {
        let c = w.ledger.open_counts(&key(b)).expect("a record per backend");
        assert_eq!(c.requests, *n, "{b}");
    }
}

#[test]
fn weights_split_the_requests_and_weight_0_gets_none() {
    let only = fx([3, 0], &[("k", "sk-oai"), ("k2", "sk-az")]);
    for _ in 0..20 {
        let left = send(&only, "/ext/duo/v1/chat/completions").unwrap();
        assert_eq!(left.backend.as_deref(), Some("oai"));
    }
    let fx = fx([3, 1], &[("k", "sk-oai"), ("k2", "sk-az")]);
    let mut az = 0;
    for _ in 0..200 {
        if send(&fx, "/v1/chat/completions")
            .unwrap()
            .backend
            .as_deref()
            == Some("az")
        {
            az += 1;
        }
    }
    // 1 in 4 expected (50); far outside chance below 25 or above 80.
    assert!((25..=80).contains(&az), "{az}");
}

#[test]
fn a_backend_without_its_credential_is_not_drawn_and_none_loaded_is_refused_after_auth() {
    let one = fx([1, 100], &[("k", "sk-oai")]);
    for _ in 0..20 {
        let left = send(&one, "/ext/duo/v1/chat/completions").unwrap();
        assert_eq!(left.backend.as_deref(), Some("oai"));
    }
    let fx = fx([1, 1], &[]);
    for path in ["/ext/duo/v1/chat/completions", "/v1/chat/completions"] {
        assert_eq!(
            send(&fx, path).err(),
            Some((503, "provider_credential_missing".to_string())),
            "{path}"
        );
    }
    // A caller without a credential learns nothing of it: 401 first.
    let (id, h) = fx.http();
    let mut r = request("/ext/duo/v1/chat/completions");
    r.remove(2);
    fx.headers(id, &h, &refs(&r), false);
    fx.body(id, &h, br#"{"model":"duo","messages":[]}"#, true);
    assert_eq!(fx.sent_to(id).map(|s| s.status), Some(401));
}

#[test]
fn an_answer_from_another_cluster_than_the_drawn_backends_is_not_passed_on() {
    let fx = fx([1, 1], &[("k", "sk-oai"), ("k2", "sk-az")]);
    for _ in 0..10 {
        let left = send(&fx, "/ext/duo/v1/chat/completions").unwrap();
        let other = if left.backend.as_deref() == Some("oai") {
            "c-az"
        } else {
            "c-oai"
        };
        assert_eq!(answer(&fx, &left, other), Action::Pause);
        let s = fx.sent_to(left.id).unwrap();
        assert_eq!((s.status, s.code().as_str()), (503, "upstream_mismatch"));
    }
}

/// The policy changes while the request waits for the companion: the drawn backend stands when
/// the new policy has it as it was (found by name, even moved); changed or gone, the request is
/// refused (its body may be written for it), never sent to another backend as this one.
#[test]
fn a_policy_change_while_waiting_keeps_the_drawn_backend_only_as_it_was() {
    let waiting = |edit: &dyn Fn(&mut Value)| -> (Fx, u32, Http) {
        // Only `oai` can serve: it is the one drawn.
        let fx = fx([1, 1], &[("k", "sk-oai")]);
        let (id, h) = fx.http();
        // A key this worker has not cached: the request waits for the companion.
        let mut r = request("/ext/duo/v1/chat/completions");
        r[2].1 = format!("Bearer {}", key(3));
        fx.headers(id, &h, &refs(&r), false);
        fx.body(id, &h, br#"{"model":"duo","messages":[]}"#, true);
        let mut p = routed_policy([1, 1]);
        edit(&mut p);
        fx.root.worker.borrow_mut().policy = Some(Rc::new(PolicyDocument::from_value(p).unwrap()));
        fx.answer(id, &h, Some(200), &alice());
        (fx, id, h)
    };
    // Moved to second place, unchanged: still it.
    let (fx, id, _) = waiting(&|p| {
        let b = p["models"][0]["backends"].as_array_mut().unwrap();
        b.reverse();
    });
    assert!(fx.sent_to(id).is_none(), "{:?}", fx.sent_to(id));
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "x-maas-backend")
            .as_deref(),
        Some("oai")
    );
    assert_eq!(
        fx.host
            .map_value(Headers::Request, "authorization")
            .as_deref(),
        Some("Bearer sk-oai")
    );
    // Its served name changed, or it is gone: refused.
    for edit in [
        &(|p: &mut Value| p["models"][0]["backends"][0]["servedName"] = json!("gpt-5"))
            as &dyn Fn(&mut Value),
        &|p: &mut Value| {
            p["models"][0]["backends"][0]["name"] = json!("renamed");
        },
    ] {
        let (fx, id, _) = waiting(edit);
        let s = fx.sent_to(id).expect("refused");
        assert_eq!((s.status, s.code().as_str()), (503, "internal"));
        let body = String::from_utf8_lossy(&s.body);
        assert!(body.contains("changed while"), "{body}");
    }
}
