//! No import cycles: layers point down. In every library crate of the
//! workspace (each member's `src/`, found from the workspace manifest, no
//! exceptions), the module files must form an acyclic import graph, so
//! each file can be read (and changed) knowing only the files below it.
//!
//! A file is a module file reached from its crate's `lib.rs` through `mod`
//! declarations (honouring `#[path]`); test-only modules and items
//! (`#[cfg(test)]`) are not part of it. File A imports file B when A's code
//! names a path (`use` trees, expressions, types, macro bodies) that
//! resolves to B's module: the longest prefix of the path that is a module
//! file. `mod b;` is not an import, but `pub use b::X;` is, so a submodule
//! importing its parent's re-export makes a cycle: import from the file
//! that defines the item.
//!
//! Run: `cargo test -p accrue-tests --test layering`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::punctuated::Punctuated;
use syn::visit::{self, Visit};
use syn::{Attribute, Expr, ExprLit, Item, Lit, Meta, Token, UseTree};

#[test]
fn no_import_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = library_sources(&root);
    assert!(
        crates.len() >= 6,
        "the workspace's library crates: {crates:?}"
    );
    let mut summary = String::new();
    let mut failed = false;
    for dir in &crates {
        let (files, cycles) = check(&root, dir);
        failed |= files == 0 || !cycles.is_empty();
        summary += &report(dir, files, &cycles);
    }
    assert!(!failed, "\n{summary}");
}

/// The `src` directory (relative to the root) of every workspace member
/// with a library target: every crate is checked, none is left out.
fn library_sources(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let manifest: toml::Table = text.parse().unwrap();
    let members = manifest["workspace"]["members"].as_array().unwrap();
    let mut dirs: Vec<String> = members
        .iter()
        .map(|m| format!("{}/src", m.as_str().unwrap()))
        .filter(|src| root.join(src).join("lib.rs").is_file())
        .collect();
    dirs.sort();
    dirs
}

/// An import between two files (relative to the root), and the first path
/// that makes it.
type Edges = BTreeMap<(String, String), String>;

/// A strongly connected set of files, and the imports among them.
struct Cycle {
    files: Vec<String>,
    edges: Vec<(String, String, String)>,
}

/// How many module files `dir` holds, and the import cycles among them.
fn check(root: &Path, dir: &str) -> (usize, Vec<Cycle>) {
    let (files, edges) = imports(root, dir);
    (files.len(), cycles(&files, &edges))
}

/// The module files under `dir` (relative to the root, sorted) and the
/// imports among them.
fn imports(root: &Path, dir: &str) -> (Vec<String>, Edges) {
    let dir = root.join(dir);
    let src = dir.ancestors().find(|p| p.ends_with("src"));
    let modules = module_files(src.expect("a checked directory is in a crate's src/"));
    let name = |file: &Path| file.strip_prefix(root).unwrap().display().to_string();
    let mut edges = Edges::new();
    for (module, (file, ast)) in modules.iter().filter(|(_, (f, _))| f.starts_with(&dir)) {
        let mut refs = Refs {
            module: module.clone(),
            found: Vec::new(),
        };
        refs.visit_file(ast);
        for (path, written) in refs.found {
            let to = owner(&modules, &path);
            if to != file && to.starts_with(&dir) {
                edges.entry((name(file), name(to))).or_insert(written);
            }
        }
    }
    let in_dir = modules.values().filter(|(f, _)| f.starts_with(&dir));
    let mut files: Vec<String> = in_dir.map(|(f, _)| name(f)).collect();
    files.sort();
    (files, edges)
}

/// The coordinator's layers, bottom first (its `src/` folders; the RL
/// loop's folder holds two: its state, scoring and engine calls below the
/// core, and the core's handlers of its events above it). A file imports
/// only files of its own layer or of layers below.
const COORDINATOR_LAYERS: &[(&str, &[&str])] = &[
    ("job", &["job/"]),
    ("stream", &["stream/"]),
    ("model", &["model/"]),
    (
        "rl: state, scoring, engine calls",
        &[
            "rl/mod.rs",
            "rl/generation.rs",
            "rl/episode.rs",
            "rl/tools.rs",
            "rl/env_command.rs",
            "rl/pg.rs",
            "rl/prompts.rs",
            "rl/rollouts.rs",
            "rl/rounds.rs",
            "rl/stream.rs",
            "rl/serve.rs",
            "rl/endpoint/",
            "rl/scorer/",
            "rl/verify/",
            "rl/engine/mod.rs",
            "rl/engine/client.rs",
            "rl/engine/wire.rs",
        ],
    ),
    ("core", &["core/"]),
    (
        "rl: the core's handlers",
        &[
            "rl/rollout_loop.rs",
            "rl/streamed.rs",
            "rl/serving.rs",
            "rl/engine/tick.rs",
        ],
    ),
    ("shell", &["shell/"]),
    ("lib", &["lib.rs"]),
];

/// The layer of a coordinator file (relative to `coordinator/src/`).
fn layer_of(file: &str) -> Option<usize> {
    COORDINATOR_LAYERS
        .iter()
        .position(|(_, parts)| parts.iter().any(|p| file.starts_with(p)))
}

#[test]
fn the_coordinators_layers_point_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let (files, edges) = imports(&root, "coordinator/src");
    let rel = |f: &str| f.strip_prefix("coordinator/src/").unwrap_or(f).to_string();
    let unplaced: Vec<String> = files
        .iter()
        .map(|f| rel(f))
        .filter(|f| layer_of(f).is_none())
        .collect();
    assert!(unplaced.is_empty(), "files in no layer: {unplaced:?}");
    let mut upward = String::new();
    for ((from, to), path) in &edges {
        let (a, b) = (layer_of(&rel(from)).unwrap(), layer_of(&rel(to)).unwrap());
        if b > a {
            let (la, lb) = (COORDINATOR_LAYERS[a].0, COORDINATOR_LAYERS[b].0);
            writeln!(upward, "  {from} ({la}) -> {to} ({lb}) via `{path}`").unwrap();
        }
    }
    assert!(
        upward.is_empty(),
        "imports from a lower layer up:\n{upward}"
    );
}

fn report(dir: &str, files: usize, cycles: &[Cycle]) -> String {
    let mut out = match (files, cycles.len()) {
        (0, _) => return format!("{dir}: no module files (moved? update CHECKED)\n"),
        (_, 0) => return format!("{dir}: ok, no import cycles among {files} files\n"),
        (_, n) => format!("{dir}: {n} import cycle(s) among {files} files\n"),
    };
    for (n, cycle) in cycles.iter().enumerate() {
        writeln!(out, "  cycle {}: {}", n + 1, cycle.files.join(", ")).unwrap();
        for (from, to, path) in &cycle.edges {
            writeln!(out, "    {from} -> {to}  via `{path}`").unwrap();
        }
    }
    out
}

// ---- Module files -------------------------------------------------------

/// Module path (`["core", "jobs"]` for `crate::core::jobs`) -> its file.
type Modules = BTreeMap<Vec<String>, (PathBuf, syn::File)>;

/// Every non-test module file of the library whose sources are in `src`
/// (binaries in `src/bin` are crates of their own).
fn module_files(src: &Path) -> Modules {
    let mut modules = Modules::new();
    add_file(Vec::new(), src.join("lib.rs"), true, &mut modules);
    modules
}

/// `mod_rs`: the file's children live beside it (`lib.rs`, `mod.rs`, a
/// `#[path]` file) rather than in a directory named after it.
fn add_file(module: Vec<String>, file: PathBuf, mod_rs: bool, modules: &mut Modules) {
    let text =
        std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
    let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("parse {}: {e}", file.display()));
    let here = file.parent().unwrap().to_path_buf();
    let children = if mod_rs {
        here.clone()
    } else {
        file.with_extension("")
    };
    add_children(&ast.items, &module, &here, &children, modules);
    modules.insert(module, (file, ast));
}

/// The files of the `mod` declarations in `items`. `#[path]` is relative to
/// `here`; a plain `mod x;` is looked for in `children`.
fn add_children(
    items: &[Item],
    module: &[String],
    here: &Path,
    children: &Path,
    modules: &mut Modules,
) {
    for item in items {
        let Item::Mod(m) = item else { continue };
        if is_test_only(&m.attrs) {
            continue;
        }
        let name = m.ident.to_string();
        let child = [module, std::slice::from_ref(&name)].concat();
        if let Some((_, inline)) = &m.content {
            let dir = children.join(&name);
            add_children(inline, &child, &dir, &dir, modules);
        } else if let Some(path) = path_attr(&m.attrs) {
            add_file(child, here.join(path), true, modules);
        } else if children.join(format!("{name}.rs")).exists() {
            add_file(child, children.join(format!("{name}.rs")), false, modules);
        } else {
            add_file(child, children.join(&name).join("mod.rs"), true, modules);
        }
    }
}

fn path_attr(attrs: &[Attribute]) -> Option<String> {
    let attr = attrs.iter().find(|a| a.path().is_ident("path"))?;
    match &attr.meta.require_name_value().ok()?.value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s.value()),
        _ => None,
    }
}

/// `#[cfg(test)]`, or `#[cfg(all(test, ...))]`: compiled only for tests.
fn is_test_only(attrs: &[Attribute]) -> bool {
    let cfg = attrs.iter().filter(|a| a.path().is_ident("cfg"));
    cfg.filter_map(|a| a.parse_args::<Meta>().ok())
        .any(|m| requires_test(&m))
}

fn requires_test(cfg: &Meta) -> bool {
    match cfg {
        Meta::Path(p) => p.is_ident("test"),
        Meta::List(list) if list.path.is_ident("all") => list
            .parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated)
            .is_ok_and(|all| all.iter().any(requires_test)),
        _ => false,
    }
}

// ---- Paths a file names -------------------------------------------------

/// The file that owns `path`: its longest prefix that is a module file (the
/// crate root owns everything else).
fn owner<'a>(modules: &'a Modules, path: &[String]) -> &'a PathBuf {
    let mut prefixes = (0..=path.len()).rev();
    let found = prefixes.find_map(|n| modules.get(&path[..n]));
    &found.expect("the crate root owns every path").0
}

/// Collects, from one file's non-test code, every path into this crate, made
/// absolute, with the path as written.
struct Refs {
    /// Where the code being visited is: the file's module, plus any inline
    /// `mod x { .. }` we are inside (`super` there is the file itself).
    module: Vec<String>,
    found: Vec<(Vec<String>, String)>,
}

impl Refs {
    fn add(&mut self, path: Vec<String>, in_use: bool) {
        if let Some(absolute) = absolute(&self.module, &path, in_use) {
            self.found.push((absolute, path.join("::")));
        }
    }
}

impl<'ast> Visit<'ast> for Refs {
    fn visit_item(&mut self, item: &'ast Item) {
        if !is_test_only(item_attrs(item)) {
            visit::visit_item(self, item);
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_only(&f.attrs) {
            visit::visit_impl_item_fn(self, f);
        }
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        // `mod x;` is ownership, not an import; inline bodies are visited.
        if let Some((_, items)) = &m.content {
            self.module.push(m.ident.to_string());
            items.iter().for_each(|item| self.visit_item(item));
            self.module.pop();
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if u.leading_colon.is_none() {
            let mut paths = Vec::new();
            use_paths(&u.tree, &mut Vec::new(), &mut paths);
            paths.into_iter().for_each(|p| self.add(p, true));
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            let segments = path.segments.iter().map(|s| s.ident.to_string());
            self.add(segments.collect(), false);
        }
        visit::visit_path(self, path); // generic arguments hold paths too
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        let mut paths = Vec::new();
        macro_paths(mac.tokens.clone(), &mut paths);
        paths.into_iter().for_each(|p| self.add(p, false));
        visit::visit_macro(self, mac);
    }

    // `pub(super)` names a module but imports nothing; attributes (doc
    // links, `#[tokio::test]`) import nothing either.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}
    fn visit_attribute(&mut self, _: &'ast Attribute) {}
}

/// The module path `path` names when written in `module`, or None when it
/// is not this crate's (`std::..`, `tch::..`, `Self::..`). In `use` and in
/// paths of two or more segments, a plain first segment may be a child
/// module (`pub use jobs::Job`); other crates resolve to the file itself.
fn absolute(module: &[String], path: &[String], in_use: bool) -> Option<Vec<String>> {
    let (head, rest) = path.split_first()?;
    let (mut base, mut segments) = match head.as_str() {
        "crate" => (Vec::new(), rest),
        "self" => (module.to_vec(), rest),
        "super" => (module.to_vec(), path),
        "Self" => return None,
        _ if in_use || path.len() > 1 => (module.to_vec(), path),
        _ => return None,
    };
    while let Some((head, rest)) = segments.split_first() {
        if head != "super" {
            break;
        }
        base.pop()?; // above the crate root: not a path we know
        segments = rest;
    }
    base.extend_from_slice(segments);
    Some(base)
}

/// Flattens a `use` tree: `use super::{a::B, c::{self, D}}` gives
/// `super::a::B`, `super::c`, `super::c::D`.
fn use_paths(tree: &UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let leaf = |ident: &syn::Ident| match ident.to_string().as_str() {
        "self" => prefix.clone(),
        name => [prefix.as_slice(), &[name.to_string()]].concat(),
    };
    match tree {
        UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        UseTree::Name(n) => out.push(leaf(&n.ident)),
        UseTree::Rename(r) => out.push(leaf(&r.ident)),
        UseTree::Glob(_) => out.push(prefix.clone()),
        UseTree::Group(g) => g.items.iter().for_each(|t| use_paths(t, prefix, out)),
    }
}

/// The `a::b::c` runs in a macro's tokens: syn leaves macro bodies
/// (`format!("{}", crate::x::f())`) unparsed.
fn macro_paths(tokens: TokenStream, out: &mut Vec<Vec<String>>) {
    let mut path = Vec::new();
    let mut colons = 0; // ':' seen since the last segment
    for token in tokens {
        match token {
            TokenTree::Ident(ident) if path.is_empty() || colons == 2 => {
                path.push(ident.to_string());
                colons = 0;
            }
            TokenTree::Punct(p) if p.as_char() == ':' && !path.is_empty() && colons < 2 => {
                colons += 1;
            }
            other => {
                out.extend((!path.is_empty()).then(|| std::mem::take(&mut path)));
                colons = 0;
                match other {
                    TokenTree::Group(group) => macro_paths(group.stream(), out),
                    TokenTree::Ident(ident) => path.push(ident.to_string()),
                    _ => {}
                }
            }
        }
    }
    out.extend((!path.is_empty()).then_some(path));
}

fn item_attrs(item: &Item) -> &[Attribute] {
    match item {
        Item::Const(i) => &i.attrs,
        Item::Enum(i) => &i.attrs,
        Item::ExternCrate(i) => &i.attrs,
        Item::Fn(i) => &i.attrs,
        Item::ForeignMod(i) => &i.attrs,
        Item::Impl(i) => &i.attrs,
        Item::Macro(i) => &i.attrs,
        Item::Mod(i) => &i.attrs,
        Item::Static(i) => &i.attrs,
        Item::Struct(i) => &i.attrs,
        Item::Trait(i) => &i.attrs,
        Item::TraitAlias(i) => &i.attrs,
        Item::Type(i) => &i.attrs,
        Item::Union(i) => &i.attrs,
        Item::Use(i) => &i.attrs,
        _ => &[],
    }
}

// ---- Cycles ---------------------------------------------------------------

/// The strongly connected components of more than one file (Tarjan).
fn cycles(files: &[String], edges: &Edges) -> Vec<Cycle> {
    let index = |file: &String| files.binary_search(file).unwrap();
    let mut next = vec![Vec::new(); files.len()];
    edges
        .keys()
        .for_each(|(from, to)| next[index(from)].push(index(to)));
    let mut tarjan = Tarjan {
        next: &next,
        order: vec![None; files.len()],
        low: vec![0; files.len()],
        ..Tarjan::default()
    };
    (0..files.len()).for_each(|v| tarjan.visit(v));
    let as_cycle = |component: Vec<usize>| {
        let mut files: Vec<String> = component.iter().map(|&v| files[v].clone()).collect();
        files.sort();
        let inside = edges
            .iter()
            .filter(|((f, t), _)| files.contains(f) && files.contains(t));
        let edges = inside
            .map(|((f, t), p)| (f.clone(), t.clone(), p.clone()))
            .collect();
        Cycle { files, edges }
    };
    let big = tarjan.components.into_iter().filter(|c| c.len() > 1);
    let mut found: Vec<Cycle> = big.map(as_cycle).collect();
    found.sort_by(|a, b| a.files.cmp(&b.files));
    found
}

#[derive(Default)]
struct Tarjan<'a> {
    next: &'a [Vec<usize>],
    order: Vec<Option<usize>>, // when each node was first reached
    low: Vec<usize>,           // the earliest node on the stack it reaches
    reached: usize,
    stack: Vec<usize>,
    components: Vec<Vec<usize>>,
}

impl Tarjan<'_> {
    fn visit(&mut self, v: usize) {
        if self.order[v].is_some() {
            return;
        }
        let reached = self.reached;
        self.reached += 1;
        (self.order[v], self.low[v]) = (Some(reached), reached);
        self.stack.push(v);
        let next = self.next;
        for &w in &next[v] {
            if self.order[w].is_none() {
                self.visit(w);
                self.low[v] = self.low[v].min(self.low[w]);
            } else if self.stack.contains(&w) {
                self.low[v] = self.low[v].min(self.order[w].unwrap());
            }
        }
        if self.low[v] == reached {
            let at = self.stack.iter().rposition(|&w| w == v).unwrap();
            self.components.push(self.stack.split_off(at));
        }
    }
}

// ---- The checker itself ---------------------------------------------------

#[test]
fn checker_finds_cycles_outside_tests_only() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    write("src/lib.rs", "mod a; mod b;");
    write("src/a.rs", "use crate::b::X; pub struct Y;");
    write("src/b.rs", "use super::a::Y; pub struct X;");

    let (files, cycles) = check(dir.path(), "src");
    assert_eq!(files, 3);
    assert_eq!(cycles.len(), 1, "{}", report("src", files, &cycles));
    assert_eq!(cycles[0].files, ["src/a.rs", "src/b.rs"]);
    let edges: Vec<_> = cycles[0].edges.iter().map(|(_, _, path)| path).collect();
    assert_eq!(edges, ["crate::b::X", "super::a::Y"]);

    // Without b's import: no cycle. With it in b's tests only: still none.
    write("src/b.rs", "pub struct X;");
    let (_, cycles) = check(dir.path(), "src");
    assert!(cycles.is_empty(), "{}", report("src", 3, &cycles));
    let tests_only = "pub struct X;\n#[cfg(test)]\nmod tests { use super::super::a::Y; }";
    write("src/b.rs", tests_only);
    let (_, cycles) = check(dir.path(), "src");
    assert!(cycles.is_empty(), "{}", report("src", 3, &cycles));

    // A child importing its parent's re-export: a cycle.
    write("src/lib.rs", "mod a; mod b; pub use a::Y; pub use b::X;");
    write("src/a.rs", "pub struct Y(crate::X);");
    let (_, cycles) = check(dir.path(), "src");
    assert_eq!(cycles.len(), 1, "{}", report("src", 3, &cycles));
    assert_eq!(cycles[0].files, ["src/a.rs", "src/lib.rs"]);
}
