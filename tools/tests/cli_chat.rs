//! `deltafin chat` from a pipe: turns reuse the conversation's state, `/save` writes the
//! conversation and its state and `--resume` picks both up, `/reset` starts over, and Ctrl-C
//! stops a reply without ending the session.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::chat_model;

fn chat(model: &Path, args: &[&str], input: &str) -> (String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "chat",
            "--model",
            model.to_str().unwrap(),
            "--temperature",
            "0",
            "-q",
        ])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    );
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

/// `(tokens, prompt, reused)` of every reply's statistics line.
fn stats(stderr: &str) -> Vec<(usize, usize, usize)> {
    stderr
        .lines()
        .filter(|l| l.starts_with('[') && l.contains("reused)]"))
        .map(|l| {
            let num = |after: &str| -> usize {
                l.split(after)
                    .nth(1)
                    .unwrap()
                    .trim_start()
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .unwrap()
                    .parse()
                    .unwrap()
            };
            (num("["), num("prompt"), num("tokens ("))
        })
        .collect()
}

#[test]
fn turns_reuse_state_and_save_resume_and_reset_work() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path());
    let saved = tmp.path().join("conv.json");
    let input = format!(
        "Hello there\nA second\\\nline\n/save {}\n/reset\nHello there\n",
        saved.display()
    );
    let (stdout, stderr) = chat(&model, &["-n", "8", "--ignore-eos"], &input);
    let s = stats(&stderr);
    assert_eq!(s.len(), 3, "{stderr}");
    assert!(s.iter().all(|t| t.0 == 8));
    assert_eq!(s[0].2, 0, "the first turn has nothing to reuse");
    // The second turn prefills only what follows the first turn's prompt.
    assert!(s[1].2 >= s[0].1 && s[1].2 < s[1].1, "{s:?}");
    // After /reset, the same first message gives the same reply as the first time.
    let replies: Vec<&str> = stdout.lines().filter(|l| !l.is_empty()).collect();
    assert!(stdout.contains(replies[0]));
    assert!(stderr.contains("conversation reset"));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&saved).unwrap()).unwrap();
    let msgs = v["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 4);
    assert_eq!(msgs[2]["content"], "A second\nline");
    assert!(saved.with_extension("json.snap").is_file());
    // --resume: the next turn starts from the saved state.
    let (_, stderr) = chat(
        &model,
        &[
            "-n",
            "4",
            "--ignore-eos",
            "--resume",
            saved.to_str().unwrap(),
        ],
        "And then?\n",
    );
    assert!(
        stderr.contains("resumed 4 messages and their state"),
        "{stderr}"
    );
    let s = stats(&stderr);
    assert!(s[0].2 > s[0].1 / 2, "resumed state not reused: {s:?}");
}

#[test]
fn ctrl_c_stops_a_reply_and_the_session_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let model = chat_model(tmp.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args([
            "chat",
            "--model",
            model.to_str().unwrap(),
            "--temperature",
            "0",
            "-q",
        ])
        .args(["-n", "3900", "--ignore-eos"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"Tell me a long story\n").unwrap();
    stdin.flush().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut buf = [0u8; 64];
    let n = stdout.read(&mut buf).unwrap();
    assert!(n > 0);
    // SAFETY: sends SIGINT to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    stdin.write_all(b"/exit\n").unwrap();
    drop(stdin);
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "chat did not end");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status:?} {stderr}");
    let s = stats(&stderr);
    assert_eq!(s.len(), 1, "{stderr}");
    assert!(stderr.contains(", stopped"), "{stderr}");
    assert!(s[0].0 < 3900, "the reply was not stopped: {s:?}");
}
