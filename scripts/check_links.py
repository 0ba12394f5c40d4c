#!/usr/bin/env python3
"""Link check for the book (docs/) and the README (run by scripts/docs.sh).

    check_links.py BOOK_HTML_DIR REPO_ROOT

Checks, offline:
- every href/src in the rendered HTML: a relative link must name a file that
  exists in the book, and a #fragment an id in that page; a link that leaves
  the book (a chapter pointing at a repository file, which works on GitHub)
  must name a file of the repository, resolved from the chapter's source;
- every link in README.md: a repository file that exists, and a #fragment an
  id of the rendered chapter (docs/src/X.md -> BOOK/X.html) or a heading of
  the README itself;
- external http(s) links are only checked to be well-formed (CI has no
  network beyond package registries).

Why not a crate: mdbook-linkcheck 0.7 is built on mdbook 0.4's types, and
mdbook-linkcheck2 0.13 (for mdbook 0.5) checks no #fragments ("fragment
resolution isn't implemented" in linkcheck2 0.10), reads only the book (not
the README) and pulls an HTTP client and tokio into every CI run. This
script is the standard library only.
"""
import html.parser
import os
import re
import sys
import urllib.parse

errors = []


class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links, self.base = set(), [], None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        if tag == "base" and a.get("href"):
            self.base = a["href"]
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.links.append((tag, a[key], self.getpos()[0]))


def parse(path):
    p = Page()
    with open(path, encoding="utf-8") as f:
        p.feed(f.read())
    return p


def external_ok(url):
    u = urllib.parse.urlsplit(url)
    if u.scheme in ("http", "https"):
        return bool(u.netloc) and " " not in url
    if u.scheme == "mailto":
        return "@" in u.path
    return False


def github_slug(heading):
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to '-'.
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def check_book(book, repo, src):
    pages = {}
    for d, _, files in os.walk(book):
        for f in files:
            if f.endswith(".html"):
                path = os.path.join(d, f)
                pages[os.path.normpath(path)] = parse(path)
    for path, page in sorted(pages.items()):
        rel = os.path.relpath(path, book)
        for tag, link, line in page.links:
            where = f"{rel}:{line}"
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):
                if not external_ok(link):
                    errors.append(f"{where}: malformed or unexpected link {link!r}")
                continue
            target, _, frag = link.partition("#")
            target, frag = urllib.parse.unquote(target), urllib.parse.unquote(frag)
            if not target:
                dest = path  # this page (404.html's <base> aside: mdbook's own)
            elif target.startswith("/"):
                dest = os.path.join(book, target.lstrip("/"))
            elif page.base and page.base.startswith("/"):
                dest = os.path.join(book, page.base.lstrip("/"), target)
            else:
                dest = os.path.join(os.path.dirname(path), target)
            dest = os.path.normpath(dest)
            if not os.path.relpath(dest, book).startswith(".."):
                if os.path.isdir(dest):
                    dest = os.path.join(dest, "index.html")
                if not os.path.exists(dest):
                    errors.append(f"{where}: {link!r}: no such file in the book")
                elif frag and dest.endswith(".html"):
                    ids = pages[dest].ids if dest in pages else parse(dest).ids
                    if frag not in ids:
                        errors.append(f"{where}: {link!r}: no id {frag!r} in {os.path.relpath(dest, book)}")
                continue
            # Leaves the book: a repository file, relative to the chapter's source.
            source_dir = os.path.join(src, os.path.dirname(rel))
            dest = os.path.normpath(os.path.join(source_dir, target))
            if not os.path.exists(dest) and dest.endswith(".html"):
                dest = dest[: -len(".html")] + ".md"  # mdbook rewrote a .md link
            if os.path.relpath(dest, repo).startswith("..") or not os.path.exists(dest):
                errors.append(f"{where}: {link!r}: leaves the book and names no repository file")
            elif frag and dest.endswith(".md") and frag not in md_slugs(dest):
                errors.append(f"{where}: {link!r}: no heading {frag!r} in {os.path.relpath(dest, repo)}")
    return pages


MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
MD_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_HREF = re.compile(r"""(?:href|src)\s*=\s*["']([^"']+)["']""")


def md_links(path):
    """(line, target) of a markdown file's links, outside code."""
    out, fence = [], False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
                continue
            if fence:
                continue
            text = re.sub(r"`[^`]*`", "", line)
            for rx in (MD_LINK, HTML_HREF):
                out += [(n, m.group(1)) for m in rx.finditer(text)]
            m = MD_REF.match(text)
            if m:
                out.append((n, m.group(1)))
    return out


def md_slugs(path):
    slugs, fence, seen = set(), False, {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith(("```", "~~~")):
                fence = not fence
            elif not fence and re.match(r"#{1,6} ", line):
                s = github_slug(re.sub(r"^#+ ", "", line).replace("`", ""))
                n = seen.get(s, 0)
                seen[s] = n + 1
                slugs.add(s if n == 0 else f"{s}-{n}")
    return slugs


def check_markdown(md, book, repo, src, pages):
    rel = os.path.relpath(md, repo)
    for line, link in md_links(md):
        where = f"{rel}:{line}"
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):
            if not external_ok(link):
                errors.append(f"{where}: malformed or unexpected link {link!r}")
            continue
        target, _, frag = link.partition("#")
        target, frag = urllib.parse.unquote(target), urllib.parse.unquote(frag)
        dest = os.path.normpath(os.path.join(os.path.dirname(md), target)) if target else md
        if os.path.relpath(dest, repo).startswith("..") or not os.path.exists(dest):
            errors.append(f"{where}: {link!r}: no such file in the repository")
            continue
        if not frag:
            continue
        in_book = os.path.relpath(dest, src)
        if not in_book.startswith("..") and dest.endswith(".md"):
            html = os.path.normpath(os.path.join(book, in_book[: -len(".md")] + ".html"))
            ids = pages[html].ids if html in pages else set()
            if frag not in ids:
                errors.append(f"{where}: {link!r}: no id {frag!r} in the rendered {os.path.relpath(html, book)}")
        elif dest.endswith(".md"):
            if frag not in md_slugs(dest):
                errors.append(f"{where}: {link!r}: no heading {frag!r} in {os.path.relpath(dest, repo)}")


def main():
    book, repo = (os.path.abspath(a) for a in sys.argv[1:3])
    src = os.path.join(repo, "docs", "src")
    pages = check_book(book, repo, src)
    check_markdown(os.path.join(repo, "README.md"), book, repo, src, pages)
    for e in errors:
        print(f"broken link: {e}", file=sys.stderr)
    if errors:
        print(f"{len(errors)} broken link(s)", file=sys.stderr)
        return 1
    n = sum(len(p.links) for p in pages.values())
    print(f"links ok: {len(pages)} pages, {n} links, and README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
