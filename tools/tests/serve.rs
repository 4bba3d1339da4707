//! `deltafin serve` under bad and busy clients: malformed requests get OpenAI-style errors,
//! oversize and hostile requests are refused, a client that leaves mid-stream stops its
//! generation, and 20 concurrent clients all get the right answer (or a 429 with Retry-After,
//! then the right answer). After each, the server is still up and answering.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::chat_model;

/// A running server; killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
            .args([
                "serve",
                "--model",
                model.to_str().unwrap(),
                "--port",
                "0",
                "-q",
            ])
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the server exited before listening")
                .unwrap();
            if let Some(rest) = line.split("on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().to_string();
            }
        };
        // Keep draining stderr so the server never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
            && request(&self.addr, "GET", "/health", b"").0 == 200
    }

    fn metric(&self, name: &str) -> f64 {
        let (status, _, body) = request(&self.addr, "GET", "/metrics", b"");
        assert_eq!(status, 200);
        let text = String::from_utf8(body).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("deltafin_{name} ")))
            .unwrap_or_else(|| panic!("no metric {name}"))
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request on a fresh connection: status, headers (lower-case names), body (de-chunked).
fn request(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> (u16, Vec<(String, String)>, Vec<u8>) {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head")
        + 4;
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v == "chunked");
    let mut body = raw[end..].to_vec();
    if chunked {
        let mut out = Vec::new();
        let mut rest = &body[..];
        loop {
            let nl = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let n = usize::from_str_radix(std::str::from_utf8(&rest[..nl]).unwrap(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.extend_from_slice(&rest[nl + 2..nl + 2 + n]);
            rest = &rest[nl + 2 + n + 2..];
        }
        body = out;
    }
    (status, headers, body)
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"model": "chatmodel", "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn post(addr: &str, path: &str, body: &Value) -> (u16, Vec<(String, String)>, Value) {
    let (status, headers, body) = request(addr, "POST", path, body.to_string().as_bytes());
    (
        status,
        headers,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

fn error_type(v: &Value) -> &str {
    v["error"]["type"].as_str().unwrap_or("")
}

#[test]
fn malformed_and_hostile_requests_get_clear_errors_and_the_server_stays_up() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Server::start(&chat_model(tmp.path()), &[]);
    let addr = server.addr.clone();
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("not JSON", b"{bad".to_vec(), 400, "not valid JSON"),
        ("not an object", b"[1,2]".to_vec(), 400, "JSON object"),
        (
            "no model",
            br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            400,
            "`model` is required",
        ),
        ("unknown model", chat_body("gpt-4", json!({})), 400, "gpt-4"),
        (
            "no messages",
            br#"{"model":"chatmodel"}"#.to_vec(),
            400,
            "messages",
        ),
        (
            "empty messages",
            br#"{"model":"chatmodel","messages":[]}"#.to_vec(),
            400,
            "non-empty",
        ),
        (
            "bad role",
            br#"{"model":"chatmodel","messages":[{"role":"wizard","content":"x"}]}"#.to_vec(),
            400,
            "role",
        ),
        ("n=2", chat_body("chatmodel", json!({"n": 2})), 400, "n = 1"),
        (
            "temperature text",
            chat_body("chatmodel", json!({"temperature": "hot"})),
            400,
            "temperature",
        ),
        (
            "temperature 9",
            chat_body("chatmodel", json!({"temperature": 9})),
            400,
            "temperature",
        ),
        (
            "max_tokens 0",
            chat_body("chatmodel", json!({"max_tokens": 0})),
            400,
            "max_tokens",
        ),
        (
            "stop 5 strings",
            chat_body("chatmodel", json!({"stop": ["a","b","c","d","e"]})),
            400,
            "stop",
        ),
        (
            "stream not bool",
            chat_body("chatmodel", json!({"stream": "yes"})),
            400,
            "stream",
        ),
        (
            "context overflow",
            chat_body("chatmodel", json!({"max_tokens": 1_000_000})),
            400,
            "context",
        ),
        (
            "context overflow, streamed",
            chat_body(
                "chatmodel",
                json!({"max_tokens": 1_000_000, "stream": true}),
            ),
            400,
            "context",
        ),
        (
            "oversize prompt",
            chat_body_content(&"word ".repeat(20_000)),
            400,
            "context",
        ),
    ];
    for (what, body, status, needle) in &cases {
        let (got, _, reply) = request(&addr, "POST", "/v1/chat/completions", body);
        let reply: Value = serde_json::from_slice(&reply).unwrap_or(Value::Null);
        assert_eq!(got, *status, "{what}: {reply}");
        assert_eq!(
            error_type(&reply),
            "invalid_request_error",
            "{what}: {reply}"
        );
        let msg = reply["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains(needle),
            "{what}: `{msg}` should mention `{needle}`"
        );
    }
    // Routes and methods.
    assert_eq!(request(&addr, "GET", "/v1/nothing", b"").0, 404);
    assert_eq!(request(&addr, "DELETE", "/v1/chat/completions", b"").0, 405);
    assert_eq!(request(&addr, "GET", "/v1/completions", b"").0, 405);
    // A body over the cap, and one merely claimed (never allocated).
    let big = vec![b' '; 17 << 20];
    assert_eq!(request(&addr, "POST", "/v1/chat/completions", &big).0, 413);
    for raw in [
        &b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 1000000000000\r\n\r\n{}"[..],
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage-that-is-a-TLS-hello\r\n\r\n",
        b"GET /health HTTP/1.1\r\nX: y\r\n",
    ] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s.write_all(raw).unwrap();
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let line = String::from_utf8_lossy(&out)
            .lines()
            .next()
            .unwrap_or("")
            .to_string();
        assert!(line.starts_with("HTTP/1.1 4"), "hostile request: {line:?}");
    }
    assert!(server.alive(), "the server died");
    // And it still answers a real request correctly after all that.
    let (status, _, reply) = post(&addr, "/v1/chat/completions", &chat("hello", 4));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], 4);
    assert!(server.metric("requests_invalid_total") >= cases.len() as f64);
}

fn chat_body(model: &str, extra: Value) -> Vec<u8> {
    let mut v =
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v.to_string().into_bytes()
}

fn chat_body_content(content: &str) -> Vec<u8> {
    chat(content, 4).to_string().into_bytes()
}

#[test]
fn a_client_that_leaves_stops_its_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Server::start(&chat_model(tmp.path()), &[]);
    let addr = server.addr.clone();
    let max = 3000;
    // Streamed: read the first events, then hang up.
    let mut body = chat("tell me everything", max);
    body["stream"] = json!(true);
    let body = body.to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("\"content\":\"") || got.len() < 600 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    drop(s);
    // Non-streamed: hang up while it is generating.
    let body = chat("and more", max).to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(120);
    while server.metric("generations_total") < 2.0 {
        assert!(Instant::now() < deadline, "the generations never ended");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, _, m) = request(&addr, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    let m = String::from_utf8(m).unwrap();
    assert_eq!(server.metric("generations_cancelled_total"), 2.0, "{m}");
    // Both stopped early: far fewer tokens than asked for.
    let tokens = server.metric("completion_tokens_total");
    assert!(
        tokens < max as f64,
        "{tokens} tokens generated for clients that left"
    );
    assert!(server.alive());
    let (status, _, reply) = post(&addr, "/v1/chat/completions", &chat("still there?", 3));
    assert_eq!(
        (status, reply["usage"]["completion_tokens"].as_u64()),
        (200, Some(3))
    );
}

#[test]
fn twenty_concurrent_clients_all_get_the_right_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let mut server = Server::start(&chat_model(tmp.path()), &["--queue", "4"]);
    let addr = server.addr.clone();
    let prompts: Vec<String> = (0..20)
        .map(|i| format!("Question {i}: what is {i} squared?"))
        .collect();
    // The answers one at a time.
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (status, _, r) = post(&addr, "/v1/chat/completions", &chat(p, 12));
            assert_eq!(status, 200, "{r}");
            r["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    // All at once, half of them streamed; a 429 waits for Retry-After and tries again.
    let rejected = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for (i, p) in prompts.iter().enumerate() {
            let (addr, expected, rejected) = (&addr, &expected, &rejected);
            s.spawn(move || {
                let mut body = chat(p, 12);
                let stream = i % 2 == 1;
                body["stream"] = json!(stream);
                for _ in 0..200 {
                    let (status, headers, raw) = request(
                        addr,
                        "POST",
                        "/v1/chat/completions",
                        body.to_string().as_bytes(),
                    );
                    if status == 429 {
                        rejected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let wait: u64 = headers
                            .iter()
                            .find(|(k, _)| k == "retry-after")
                            .expect("429 without Retry-After")
                            .1
                            .parse()
                            .unwrap();
                        assert!((1..=3600).contains(&wait));
                        std::thread::sleep(Duration::from_millis(200 * wait.min(5)));
                        continue;
                    }
                    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&raw));
                    let content = if stream {
                        stream_content(&raw)
                    } else {
                        let v: Value = serde_json::from_slice(&raw).unwrap();
                        v["choices"][0]["message"]["content"]
                            .as_str()
                            .unwrap()
                            .to_string()
                    };
                    assert_eq!(content, expected[i], "client {i} got another answer");
                    return;
                }
                panic!("client {i} never got through");
            });
        }
    });
    assert!(server.alive());
    assert_eq!(
        server.metric("requests_rejected_total") as usize,
        rejected.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(server.metric("requests_queued"), 0.0);
}

/// The content of a chat event stream, pieces joined; checks it ends with `[DONE]`.
fn stream_content(raw: &[u8]) -> String {
    let text = String::from_utf8(raw.to_vec()).unwrap();
    let mut out = String::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            out.push_str(c);
        }
    }
    assert!(done, "the stream did not end with [DONE]");
    out
}
