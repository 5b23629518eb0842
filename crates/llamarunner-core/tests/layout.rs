//! The crate's layout rules (docs/architecture.md), read from the source: every `crate::...`
//! path and every use of llama-cpp-2 outside comments and test modules. A failure names the file,
//! the line and the rule.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One non-test, non-comment line of a source file.
struct Line {
    number: usize,
    text: String,
    /// Whether the item on this line is compiled only without llama.cpp (the fake build) or only
    /// for tests: `#[cfg(test)]` or `#[cfg(not(feature = "llama"))]` just above it.
    gated: bool,
}

struct Source {
    /// The path below `src/`, with `/` separators.
    path: String,
    lines: Vec<Line>,
}

impl Source {
    /// The top-level module the file belongs to: its folder, or its own name for a file at the
    /// crate root (`config`, `runner`, ...).
    fn module(&self) -> &str {
        let first = self.path.split('/').next().unwrap_or("");
        first.strip_suffix(".rs").unwrap_or(first)
    }

    fn is_folder(&self) -> bool {
        self.path.contains('/')
    }
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// A file's lines that production code compiles: comments dropped, and everything from a
/// `#[cfg(test)]` module on (test modules sit at the end of their files). Files that are test
/// modules themselves (`tests.rs`, `tests/...`) hold no production lines.
fn production_lines(path: &str, text: &str) -> Vec<Line> {
    if path.ends_with("/tests.rs") || path.contains("/tests/") {
        return Vec::new();
    }
    let mut lines = Vec::new();
    let mut gate_next = false;
    let all: Vec<&str> = text.lines().collect();
    for (i, raw) in all.iter().enumerate() {
        let trimmed = raw.trim_start();
        if trimmed.starts_with("#[cfg(test)]")
            && all
                .get(i + 1)
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            break;
        }
        if trimmed.starts_with("//") {
            continue;
        }
        let code = match trimmed.find("//") {
            Some(at) => &trimmed[..at],
            None => trimmed,
        };
        let gated = gate_next;
        gate_next = code.starts_with("#[cfg(test)]")
            || code.starts_with("#[cfg(not(feature = \"llama\"))]");
        lines.push(Line {
            number: i + 1,
            text: code.to_string(),
            gated,
        });
    }
    lines
}

fn sources() -> Vec<Source> {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(
        files.len() > 20,
        "found only {} files in {}",
        files.len(),
        root.display()
    );
    files
        .into_iter()
        .map(|file| {
            let path = file
                .strip_prefix(&root)
                .expect("below src/")
                .to_string_lossy()
                .replace('\\', "/");
            let text = fs::read_to_string(&file).expect("a readable source file");
            let lines = production_lines(&path, &text);
            Source { path, lines }
        })
        .collect()
}

/// The paths a line names through `crate::`, as their module segments: `crate::a::b::C` gives
/// `["a", "b", "C"]`; `crate::{a::X, b}` gives `["a", "X"]` and `["b"]`.
fn crate_paths(line: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `llama_cpp_sys_2::...`-like names that end in "crate"
        }
        paths_at(rest, &mut Vec::new(), &mut found);
    }
    found
}

/// Reads a use-tree at the start of `text` below `prefix`.
fn paths_at(text: &str, prefix: &mut Vec<String>, found: &mut Vec<Vec<String>>) {
    let mut text = text;
    let depth = prefix.len();
    loop {
        if let Some(inner) = text.strip_prefix('{') {
            for part in split_group(inner) {
                paths_at(part.trim(), prefix, found);
            }
            break;
        }
        let end = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        if end == 0 {
            break;
        }
        prefix.push(text[..end].to_string());
        match text[end..].strip_prefix("::") {
            Some(next) => text = next,
            None => {
                found.push(prefix.clone());
                break;
            }
        }
    }
    if prefix.len() > depth && !found.last().is_some_and(|last| last.starts_with(prefix)) {
        found.push(prefix.clone());
    }
    prefix.truncate(depth);
}

/// The top-level comma-separated parts of a `{...}` group (the text after its `{`).
fn split_group(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                parts.push(&text[start..i]);
                return parts;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

/// Every production import of the crate: (file, line number, the path's segments).
fn imports(sources: &[Source]) -> Vec<(&Source, &Line, Vec<String>)> {
    let mut out = Vec::new();
    for source in sources {
        for line in &source.lines {
            for path in crate_paths(&line.text) {
                out.push((source, line, path));
            }
        }
    }
    out
}

#[test]
fn the_import_reader_reads_paths_and_groups() {
    assert_eq!(
        crate_paths("use crate::a::b::C;"),
        vec![vec!["a", "b", "C"]]
    );
    assert_eq!(
        crate_paths("use crate::{a::X, b::{c, d::E}, f};"),
        vec![
            vec!["a", "X"],
            vec!["b", "c"],
            vec!["b", "d", "E"],
            vec!["f"]
        ]
    );
    assert_eq!(
        crate_paths("let x = crate::kv::plan(1);"),
        vec![vec!["kv", "plan"]]
    );
    assert!(crate_paths("llama_cpp_sys_2::llama_model").is_empty());
    let lines = production_lines(
        "kv/mod.rs",
        "use crate::a;\n// crate::b\n#[cfg(test)]\nuse crate::c;\n#[cfg(test)]\nmod tests {\nuse crate::d;\n}\n",
    );
    let seen: Vec<(bool, Vec<Vec<String>>)> = lines
        .iter()
        .map(|l| (l.gated, crate_paths(&l.text)))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    assert_eq!(
        seen,
        vec![
            (false, vec![vec!["a".to_string()]]),
            (true, vec![vec!["c".to_string()]])
        ]
    );
}

/// The production lines, as `src/PATH:LINE: TEXT`, of the files `inside` takes that name any
/// of `words`.
fn lines_naming(inside: impl Fn(&str) -> bool, words: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for source in sources().into_iter().filter(|s| inside(&s.path)) {
        for line in &source.lines {
            if words.iter().any(|w| line.text.contains(w)) {
                found.push(format!(
                    "src/{}:{}: {}",
                    source.path,
                    line.number,
                    line.text.trim()
                ));
            }
        }
    }
    found
}

#[test]
fn only_backend_llama_uses_llama_cpp() {
    let wrong = lines_naming(
        |path| !path.starts_with("backend/llama/"),
        &["llama_cpp_2::", "llama_cpp_sys_2::"],
    );
    assert!(
        wrong.is_empty(),
        "only backend/llama/ may use llama-cpp-2 or llama-cpp-sys-2:\n{}",
        wrong.join("\n")
    );
}

/// Modules that a folder's production code may not name.
const FORBIDDEN: &[(&str, &[&str], &str)] = &[
    (
        "dialects",
        &["backend", "engine", "sched"],
        "dialects/ speaks wire formats to protocol/; it never reaches the backend, the engine \
         loop or the scheduler",
    ),
    (
        "kv",
        &["http", "dialects", "requests", "ops"],
        "kv/ is pure bookkeeping below HTTP",
    ),
    (
        "sched",
        &["http", "dialects", "requests", "ops"],
        "sched/ runs on the engine thread, below HTTP",
    ),
    (
        "chat",
        &["http", "dialects", "requests", "ops"],
        "chat/ is pure text, below HTTP",
    ),
    (
        "constrain",
        &["http", "dialects", "requests", "ops"],
        "constrain/ is below HTTP",
    ),
    (
        "protocol",
        &[
            "http", "dialects", "requests", "ops", "backend", "engine", "sched",
        ],
        "protocol/ is what HTTP and the engine say to each other; it depends on neither",
    ),
    (
        "backend",
        &["http", "dialects", "requests", "ops", "engine", "sched"],
        "backend/ implements the Backend trait; the engine drives it, never the reverse",
    ),
    (
        "router",
        &["backend", "engine", "sched", "kv", "constrain", "chat"],
        "router/ fronts engine processes over HTTP; it never runs a model itself",
    ),
];

#[test]
fn folders_import_only_what_their_rules_allow() {
    let sources = sources();
    let mut wrong = Vec::new();
    for (source, line, path) in imports(&sources) {
        for (folder, forbidden, why) in FORBIDDEN {
            if source.is_folder() && source.module() == *folder && forbidden.contains(&&*path[0]) {
                wrong.push(format!(
                    "src/{}:{}: crate::{} ({why})",
                    source.path,
                    line.number,
                    path.join("::")
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layout rules:\n{}",
        wrong.join("\n")
    );
}

/// What the policy folders leave to the engine: channels and the threads' waiting.
const CHANNEL_WORDS: &[&str] = &["mpsc", "oneshot", "crossbeam", "Sender<", "Receiver<"];

#[test]
fn the_scheduler_and_the_caches_touch_no_channel() {
    let wrong = lines_naming(
        |path| path.starts_with("sched/") || path.starts_with("kv/"),
        CHANNEL_WORDS,
    );
    assert!(
        wrong.is_empty(),
        "sched/ and kv/ are policy: they offer events to a request's EventSink and hand \
         endings to the engine (engine/delivery.rs), never a channel:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn nothing_but_tests_and_the_fake_build_imports_the_fake_backend() {
    let sources = sources();
    let mut wrong = Vec::new();
    for (source, line, path) in imports(&sources) {
        let fake = path.len() >= 2 && path[0] == "backend" && path[1] == "fake";
        if fake && !line.gated && !source.path.starts_with("backend/fake/") {
            wrong.push(format!(
                "src/{}:{}: crate::{}",
                source.path,
                line.number,
                path.join("::")
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "production code imports backend/fake/ (allowed only in tests and under \
         #[cfg(not(feature = \"llama\"))]):\n{}",
        wrong.join("\n")
    );
}

/// The crate's top-level modules: its folders and its root files (`config`, `runner`, ...).
fn top_modules(sources: &[Source]) -> BTreeSet<&str> {
    sources
        .iter()
        .map(Source::module)
        .filter(|m| *m != "lib")
        .collect()
}

/// A depth-first search for cycles in `edges` (node -> node -> where the edge is first seen);
/// each cycle as its steps.
fn cycles(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<String> {
    fn visit(
        at: &str,
        edges: &BTreeMap<String, BTreeMap<String, String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<String>,
    ) {
        if let Some(i) = stack.iter().position(|f| f == at) {
            let cycle = &stack[i..];
            let steps: Vec<String> = cycle
                .iter()
                .enumerate()
                .map(|(k, from)| {
                    let to = cycle.get(k + 1).map_or(at, String::as_str);
                    format!("{from} -> {to} (at {})", edges[from][to])
                })
                .collect();
            found.push(steps.join(", "));
            return;
        }
        if !done.insert(at.to_string()) {
            return;
        }
        stack.push(at.to_string());
        if let Some(next) = edges.get(at) {
            for to in next.keys() {
                visit(to, edges, stack, done, found);
            }
        }
        stack.pop();
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        visit(node, edges, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn no_top_level_modules_import_each_other_root_files_included() {
    // Root files are nodes too: `config.rs` and `routes.rs` sit below the folders that read
    // them, `runner.rs` above everything; none may be imported back by what it imports.
    let sources = sources();
    let modules = top_modules(&sources);
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (source, line, path) in imports(&sources) {
        let to = path[0].as_str();
        if !modules.contains(to) || to == source.module() {
            continue;
        }
        edges
            .entry(source.module().to_string())
            .or_default()
            .entry(to.to_string())
            .or_insert_with(|| format!("src/{}:{}", source.path, line.number));
    }
    let found = cycles(&edges);
    assert!(
        found.is_empty(),
        "top-level modules that import each other:\n{}",
        found.join("\n")
    );
}

/// The sibling files a line of `folder/file.rs` names: `super::x`, `crate::folder::x` and
/// (in a `mod.rs`) `x::` where `x` is a file of the folder.
fn sibling_refs(line: &str, folder: &str, own: &str, siblings: &BTreeSet<String>) -> Vec<String> {
    let mut named = Vec::new();
    let mut heads: Vec<String> = Vec::new();
    for path in crate_paths(line) {
        if path.len() >= 2 && path[..path.len() - 1].join("/") == folder {
            heads.push(path[path.len() - 1].clone());
        }
        let parts: Vec<&str> = folder.split('/').collect();
        if path.len() > parts.len() && path.iter().zip(&parts).all(|(a, b)| a == b) {
            heads.push(path[parts.len()].clone());
        }
    }
    let mut rest = line;
    while let Some(at) = rest.find("super::") {
        rest = &rest[at + "super::".len()..];
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        heads.push(rest[..end].to_string());
    }
    if own == "mod" {
        for sibling in siblings {
            if line.contains(&format!("{sibling}::")) {
                heads.push(sibling.clone());
            }
        }
    }
    for head in heads {
        if head != own && head != "mod" && siblings.contains(&head) && !named.contains(&head) {
            named.push(head);
        }
    }
    named
}

#[test]
fn no_files_of_one_folder_import_each_other() {
    // The files of a folder (its mod.rs aside: the folder's face, which its files build on)
    // form no cycle.
    let sources = sources();
    let mut by_folder: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for source in &sources {
        if let Some((folder, file)) = source.path.rsplit_once('/') {
            if let Some(stem) = file.strip_suffix(".rs") {
                by_folder
                    .entry(folder.to_string())
                    .or_default()
                    .insert(stem.to_string());
            }
        }
    }
    let mut found = Vec::new();
    for (folder, files) in &by_folder {
        let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for source in &sources {
            let Some((f, file)) = source.path.rsplit_once('/') else {
                continue;
            };
            if f != folder || file == "mod.rs" {
                continue;
            }
            let own = file.trim_end_matches(".rs");
            for line in &source.lines {
                for to in sibling_refs(&line.text, folder, own, files) {
                    edges
                        .entry(own.to_string())
                        .or_default()
                        .entry(to)
                        .or_insert_with(|| format!("src/{}:{}", source.path, line.number));
                }
            }
        }
        for cycle in cycles(&edges) {
            found.push(format!("{folder}/: {cycle}"));
        }
    }
    assert!(
        found.is_empty(),
        "files of one folder that import each other:\n{}",
        found.join("\n")
    );
}

/// Lines a source file may have; the files still over it, each with why.
const MAX_LINES: usize = 900;
/// (None now: a file that grows past the limit is split in the change that grows it.)
const OVER_MAX_LINES: &[(&str, &str)] = &[];

#[test]
fn no_source_file_is_longer_than_the_limit() {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let mut wrong = Vec::new();
    let mut fixed = Vec::new();
    for file in files {
        let path = file
            .strip_prefix(&root)
            .expect("below src/")
            .to_string_lossy()
            .replace('\\', "/");
        let n = fs::read_to_string(&file).expect("readable").lines().count();
        let allowed = OVER_MAX_LINES.iter().any(|(p, _)| *p == path);
        if n > MAX_LINES && !allowed {
            wrong.push(format!("src/{path}: {n} lines"));
        }
        if n <= MAX_LINES && allowed {
            fixed.push(format!(
                "src/{path}: {n} lines (take it off OVER_MAX_LINES)"
            ));
        }
    }
    assert!(
        wrong.is_empty() && fixed.is_empty(),
        "source files over {MAX_LINES} lines (split them by concern):\n{}",
        wrong
            .into_iter()
            .chain(fixed)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Names a comment may put before `::` or `/` that are not this crate's modules: external
/// crates, primitive types, llama.cpp's own source folders, media types.
const FOREIGN_NAMES: &[&str] = &[
    "std",
    "core",
    "alloc",
    "axum",
    "tokio",
    "serde",
    "serde_json",
    "llama_cpp_2",
    "llama_cpp_sys_2",
    "llguidance",
    "prometheus",
    "tower",
    "tower_http",
    "hyper",
    "minijinja",
    "u64",
    "u32",
    "i32",
    "usize",
    "f32",
    "tools",
    "ggml",
    "common",
    "tests",
    "benches",
    "docs",
    "python",
    "llamarunner",
    "image",
    "text",
    "application",
    "crates",
];

/// The backticked module paths in a comment: `a::b`, `a/b.rs` or `a/`, as their segments.
fn comment_paths(comment: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, quoted) in comment.split('`').enumerate() {
        if i % 2 == 0 || quoted.contains(' ') {
            continue;
        }
        let sep = if quoted.contains("::") { "::" } else { "/" };
        if !quoted.contains(sep) {
            continue;
        }
        let segments: Vec<String> = quoted
            .split(sep)
            .map(|s| s.trim_end_matches(".rs").to_string())
            .collect();
        let first = &segments[0];
        if !first.is_empty() && first.chars().all(|c| c.is_ascii_lowercase() || c == '_') {
            out.push(segments);
        }
    }
    out
}

#[test]
fn comments_name_only_modules_that_exist() {
    let root = src_dir();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let modules: BTreeSet<String> = fs::read_dir(&root)
        .expect("src/")
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            Some(name.trim_end_matches(".rs").to_string())
        })
        .collect();
    let mut wrong = Vec::new();
    for file in files {
        let text = fs::read_to_string(&file).expect("readable");
        let path = file.strip_prefix(&root).expect("below src/").to_path_buf();
        let here = file.parent().expect("a folder").to_path_buf();
        for (n, line) in text.lines().enumerate() {
            let Some(at) = line.find("//") else {
                continue;
            };
            for segments in comment_paths(&line[at..]) {
                let first = segments[0].as_str();
                if FOREIGN_NAMES.contains(&first) {
                    continue;
                }
                // A file or folder beside this one (`draft.rs`, `llama/`) or below.
                let local = here.join(first);
                if local.is_dir() || local.with_extension("rs").is_file() {
                    continue;
                }
                let exists = modules.contains(first) && {
                    // The second segment, when it is a module (lowercase), exists there.
                    match segments.get(1).map(String::as_str) {
                        Some(second)
                            if !second.is_empty()
                                && second.chars().all(|c| c.is_ascii_lowercase() || c == '_') =>
                        {
                            let dir = root.join(first);
                            dir.join(second).is_dir()
                                || dir.join(second).with_extension("rs").is_file()
                                || fs::read_to_string(dir.join("mod.rs"))
                                    .is_ok_and(|m| m.contains(&format!("fn {second}")))
                        }
                        _ => true,
                    }
                };
                if !exists {
                    wrong.push(format!(
                        "src/{}:{}: `{}`",
                        path.display(),
                        n + 1,
                        segments.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "comments that name modules that do not exist:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_comment_and_sibling_readers_find_what_they_should() {
    assert_eq!(
        comment_paths("// see `server::validate` and `sched/batch.rs`, not `a b::c` or `x`"),
        vec![vec!["server", "validate"], vec!["sched", "batch"]]
    );
    let siblings: BTreeSet<String> = ["a", "b", "mod"].iter().map(|s| s.to_string()).collect();
    assert_eq!(
        sibling_refs("use super::b::X;", "f", "a", &siblings),
        vec!["b"]
    );
    assert_eq!(
        sibling_refs("use crate::f::b;", "f", "a", &siblings),
        vec!["b"]
    );
    assert!(sibling_refs("use super::*;", "f", "a", &siblings).is_empty());
    assert!(sibling_refs("use super::a::Y;", "f", "a", &siblings).is_empty());
    let edges: BTreeMap<String, BTreeMap<String, String>> = [("a", "b"), ("b", "c"), ("c", "a")]
        .iter()
        .map(|(f, t)| {
            (
                f.to_string(),
                BTreeMap::from([(t.to_string(), "here".to_string())]),
            )
        })
        .collect();
    assert_eq!(cycles(&edges).len(), 1);
}
