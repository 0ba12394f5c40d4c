//! Integration tests live in `tests/tests/`; they run the real binaries.
