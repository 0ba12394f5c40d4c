#!/usr/bin/env bash
# Builds the book (docs/, an mdBook) into target/book/ and checks every link:
# the rendered chapters' links and #anchors, links leaving the book for
# repository files, and README.md's links into the book
# (scripts/check_links.py; external http(s) links are checked for form only,
# never fetched). Installs the pinned mdbook into .tools/ first when it is
# missing (cargo install: a few minutes, once). CI runs it (.ci/run).
#   scripts/docs.sh            then open target/book/index.html
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
tools="$PWD/.tools"
mdbook="$tools/bin/mdbook"
if [[ "$("$mdbook" --version 2>/dev/null)" != "mdbook v$MDBOOK_VERSION" ]]; then
  echo "docs: installing mdbook $MDBOOK_VERSION into .tools/ (once)" >&2
  # Without `serve` and `watch` (a local server and file watching): only the
  # build is needed, and they double the compile.
  cargo install mdbook --locked --version "$MDBOOK_VERSION" \
    --no-default-features --features search --root "$tools"
fi
out="$PWD/target/book"
rm -rf "$out"
"$mdbook" build docs --dest-dir "$out"
python3 scripts/check_links.py "$out" .
echo "docs: target/book/index.html"
