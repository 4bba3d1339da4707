//! The workspace's shape, checked on its sources (ARCHITECTURE.md states these rules):
//! - no source file over 600 lines, except the per-ISA SIMD kernel files;
//! - no import circles between the files of a crate (a `use crate::...` or `super::...` path,
//!   or a qualified path in code, is an edge to the file that defines the module it names);
//! - `inference` uses no storage type below the expert store's API (no `Lane`, `Ticket`,
//!   `ReadBuf`, `align_up`, engine handle or buffer pool);
//! - `storage` names no model family.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: &[&str] = &["formats", "storage", "inference", "chat", "tools"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The source without comments and string/char literals (so paths in prose do not count).
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3; // 'c'
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// The module path of a source file (`src/a/b.rs` and `src/a/b/mod.rs` are `[a, b]`).
fn module_of(src_dir: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src_dir).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().to_string())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// Expand a `use` tree (`a::{b, c::{d, e as f}}`) into paths, each with the name it binds.
fn expand(tree: &str) -> Vec<(String, String)> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let mut it = tree.split(" as ");
        let path = it.next().unwrap_or("").trim().to_string();
        let name = match it.next() {
            Some(alias) => alias.trim().to_string(),
            None => path.rsplit("::").next().unwrap_or("").trim().to_string(),
        };
        return vec![(path, name)];
    };
    let prefix = tree[..open].trim_end_matches("::").trim();
    let inner = &tree[open + 1..tree.rfind('}').unwrap()];
    let mut items = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
        .into_iter()
        .filter(|s| !s.trim().is_empty())
        .flat_map(|s| {
            expand(s)
                .into_iter()
                .map(|(p, name)| match p.as_str() {
                    "self" => {
                        let own = prefix.rsplit("::").next().unwrap_or("").to_string();
                        let name = if name == "self" { own } else { name };
                        (prefix.to_string(), name)
                    }
                    _ => (format!("{prefix}::{p}"), name),
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// What one file refers to inside its crate.
#[derive(Default)]
struct FileRefs {
    /// Absolute module paths the file's code and `use` statements name.
    paths: Vec<Vec<String>>,
    /// `pub use` re-exports: the name bound in this module → the absolute path it stands for.
    reexports: BTreeMap<String, Vec<String>>,
}

/// Turn a path as written in `module` into an absolute one; `None` for other crates.
fn absolute(
    segs: &[&str],
    module: &[String],
    modules: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let own = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    match segs.first().copied() {
        Some("crate") => Some(own(&segs[1..])),
        Some("super") => {
            // `super` of `a::b` (whether `a/b.rs` or `a/b/mod.rs`) is `a`.
            let mut base = module.to_vec();
            let mut k = 0;
            while segs.get(k) == Some(&"super") {
                base.pop();
                k += 1;
            }
            base.extend(own(&segs[k..]));
            Some(base)
        }
        Some("self") => {
            let mut base = module.to_vec();
            base.extend(own(&segs[1..]));
            Some(base)
        }
        // A relative path through a child module (`use child::Item;` in a mod.rs).
        Some(first) => {
            let mut child = module.to_vec();
            child.push(first.to_string());
            modules.contains_key(&child).then(|| {
                child.extend(own(&segs[1..]));
                child
            })
        }
        None => None,
    }
}

/// Paths a file refers to inside its crate, as absolute module paths, and its re-exports.
fn crate_refs(code: &str, module: &[String], modules: &BTreeMap<Vec<String>, PathBuf>) -> FileRefs {
    let mut refs = FileRefs::default();
    // `use` statements (possibly multi-line).
    let mut rest = code;
    while let Some(i) = rest.find("use ") {
        let before_text = rest[..i].trim_end();
        let before = rest[..i].chars().last();
        let tail = &rest[i + 4..];
        let Some(end) = tail.find(';') else { break };
        if before.is_none_or(|c| !c.is_alphanumeric() && c != '_') {
            let public = before_text.ends_with("pub") || before_text.ends_with(')');
            for (path, name) in expand(&tail[..end]) {
                let segs: Vec<&str> = path.split("::").map(str::trim).collect();
                if let Some(abs) = absolute(&segs, module, modules) {
                    if public && name != "*" {
                        refs.reexports.insert(name, abs.clone());
                    }
                    refs.paths.push(abs);
                }
            }
        }
        rest = &tail[end..];
    }
    // Qualified paths in code.
    for key in ["crate::", "super::"] {
        let mut s = code;
        while let Some(i) = s.find(key) {
            let before = s[..i].chars().last();
            let tail = &s[i..];
            let end = tail
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(tail.len());
            // `a::b::{...}` and `a::b::*` are `use` trees, read above.
            let tree = tail[..end].ends_with("::");
            if !tree && before.is_none_or(|c| !c.is_alphanumeric() && c != '_' && c != ':') {
                let path = &tail[..end];
                let segs: Vec<&str> = path.split("::").collect();
                if let Some(abs) = absolute(&segs, module, modules) {
                    refs.paths.push(abs);
                }
            }
            s = &tail[end.max(1)..];
        }
    }
    refs
}

type Reexports = BTreeMap<Vec<String>, BTreeMap<String, Vec<String>>>;

/// The file defining what `path` names: the longest module prefix, followed through a
/// re-export when the next segment is one (so `super::Item` re-exported by a mod.rs leads to
/// the file that defines `Item`, not to the mod.rs).
fn resolve(
    modules: &BTreeMap<Vec<String>, PathBuf>,
    reexports: &Reexports,
    path: &[String],
    depth: usize,
) -> Option<PathBuf> {
    let k = (0..=path.len())
        .rev()
        .find(|&k| modules.contains_key(&path[..k]))?;
    if depth < 8 && k < path.len() {
        if let Some(target) = reexports.get(&path[..k]).and_then(|m| m.get(&path[k])) {
            let mut next = target.clone();
            next.extend(path[k + 1..].iter().cloned());
            if next != path {
                return resolve(modules, reexports, &next, depth + 1);
            }
        }
    }
    modules.get(&path[..k]).cloned()
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct T<'g> {
        g: &'g BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'g PathBuf, usize>,
        low: BTreeMap<&'g PathBuf, usize>,
        stack: Vec<&'g PathBuf>,
        on: BTreeSet<&'g PathBuf>,
        next: usize,
        out: Vec<Vec<PathBuf>>,
    }
    fn visit<'g>(t: &mut T<'g>, v: &'g PathBuf) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flatten() {
            if !t.index.contains_key(w) {
                visit(t, w);
                let lw = t.low[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if t.on.contains(w) {
                let iw = t.index[w];
                let lv = t.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if t.low[v] == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The import graph of one crate's `src/` (a binary's `main.rs` and library's `lib.rs` alike).
fn import_graph(src_dir: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let files: Vec<PathBuf> = rust_files(src_dir)
        .into_iter()
        .filter(|f| !f.starts_with(src_dir.join("bin")))
        .collect();
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(src_dir, f), f.clone()))
        .collect();
    let mut refs = BTreeMap::new();
    let mut reexports: Reexports = BTreeMap::new();
    for f in &files {
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        // Tests inside a file import what they test; they are not part of the module graph.
        let code = match code.find("#[cfg(test)]") {
            Some(i) => &code[..i],
            None => &code[..],
        };
        let module = module_of(src_dir, f);
        let file_refs = crate_refs(code, &module, &modules);
        reexports.insert(module, file_refs.reexports);
        refs.insert(f.clone(), file_refs.paths);
    }
    refs.into_iter()
        .map(|(f, paths)| {
            let edges: BTreeSet<PathBuf> = paths
                .iter()
                .filter_map(|p| resolve(&modules, &reexports, p, 0))
                .filter(|t| *t != f)
                .collect();
            (f, edges)
        })
        .collect()
}

#[test]
fn no_source_file_over_600_lines() {
    let simd = ["x86.rs", "x86_avx512.rs", "aarch64.rs"];
    let mut over = Vec::new();
    for c in CRATES {
        for dir in ["src", "tests", "benches", "examples"] {
            for f in rust_files(&root().join(c).join(dir)) {
                let lines = std::fs::read_to_string(&f).unwrap().lines().count();
                let kernel = f.parent().is_some_and(|p| p.ends_with("kernels"))
                    && simd.iter().any(|s| f.ends_with(s));
                if lines > 600 && !kernel {
                    over.push(format!("{} ({lines} lines)", f.display()));
                }
            }
        }
    }
    assert!(over.is_empty(), "files over 600 lines: {over:#?}");
}

#[test]
fn no_import_circles_between_files() {
    let mut found = Vec::new();
    for c in CRATES {
        let g = import_graph(&root().join(c).join("src"));
        assert!(g.len() > 3, "{c}: no files found");
        for comp in cycles(&g) {
            // The edges inside the circle, so the message says which imports to cut.
            let short = |p: &PathBuf| p.strip_prefix(root()).unwrap_or(p).display().to_string();
            let mut edges = Vec::new();
            for a in &comp {
                for b in g[a].iter().filter(|b| comp.contains(b)) {
                    edges.push(format!("{} -> {}", short(a), short(b)));
                }
            }
            found.push(edges);
        }
    }
    assert!(found.is_empty(), "import circles: {found:#?}");
}

/// The checker finds a circle when there is one.
#[test]
fn the_circle_check_sees_a_circle() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path();
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "pub mod a;\npub mod b;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "pub mod c;\nuse crate::b::X;\n").unwrap();
    std::fs::write(src.join("a/c.rs"), "pub struct Y;\n").unwrap();
    std::fs::write(
        src.join("b.rs"),
        "pub struct X;\nfn f() { let _ = crate::a::c::Y; }\nuse super::a::{self, c::Y};\n",
    )
    .unwrap();
    let g = import_graph(src);
    let c = cycles(&g);
    assert_eq!(c.len(), 1, "{g:#?}");
    assert_eq!(c[0].len(), 2);
    // Comments and strings do not count.
    std::fs::write(
        src.join("b.rs"),
        "pub struct X;\n// use crate::a::c::Y;\nconst S: &str = \"crate::a::c\";\n",
    )
    .unwrap();
    assert!(cycles(&import_graph(src)).is_empty());
    // A relative `use child::Item` in a mod.rs is an edge to the child...
    std::fs::write(
        src.join("a/mod.rs"),
        "pub mod c;\nuse c::Y;\npub struct Z;\n",
    )
    .unwrap();
    std::fs::write(src.join("a/c.rs"), "pub struct Y;\nuse super::Z;\n").unwrap();
    assert_eq!(cycles(&import_graph(src)).len(), 1);
    // ...but a child naming an item its mod.rs re-exports from a sibling depends on the
    // sibling, not on the mod.rs.
    std::fs::write(
        src.join("a/mod.rs"),
        "pub mod c;\npub mod d;\npub use d::W;\nuse c::Y;\n",
    )
    .unwrap();
    std::fs::write(src.join("a/c.rs"), "pub struct Y;\nuse super::W;\n").unwrap();
    std::fs::write(src.join("a/d.rs"), "pub struct W;\n").unwrap();
    assert!(
        cycles(&import_graph(src)).is_empty(),
        "{:#?}",
        import_graph(src)
    );
}

#[test]
fn inference_uses_only_the_expert_store_api() {
    let forbidden = [
        "Lane",
        "Ticket",
        "ReadBuf",
        "align_up",
        "Engine",
        "EngineConfig",
        "BufferPool",
        "Completion",
        "Target",
    ];
    let mut found = Vec::new();
    for f in rust_files(&root().join("inference").join("src")) {
        let code = code_only(&std::fs::read_to_string(&f).unwrap());
        for word in &forbidden {
            let hit = code.match_indices(word).any(|(i, _)| {
                let before = code[..i].chars().last();
                let after = code[i + word.len()..].chars().next();
                let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
                // `type Target = ...` is `Deref`'s associated type, not the storage one.
                let deref_target = *word == "Target" && code[..i].ends_with("type ");
                !ident(before) && !ident(after) && !deref_target
            });
            if hit {
                found.push(format!("{}: {word}", f.display()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "storage internals used by inference: {found:#?}"
    );
}

#[test]
fn storage_names_no_model_family() {
    let families = [
        "deepseek", "qwen", "kimi", "llama", "mixtral", "mistral", "gpt", "glm", "minimax",
    ];
    let mut found = Vec::new();
    for f in rust_files(&root().join("storage").join("src")) {
        let text = std::fs::read_to_string(&f).unwrap().to_lowercase();
        for fam in &families {
            if text.contains(fam) {
                found.push(format!("{}: {fam}", f.display()));
            }
        }
    }
    assert!(found.is_empty(), "storage knows model families: {found:#?}");
}
