//! The shell around the pure core: the server (gRPC services, HTTP status
//! page and Prometheus metrics), the embedded store, authentication and
//! TLS, the job's output files and tracking, and admission (reading what
//! a spec points at). Everything that touches a socket, a clock or the
//! disk on the running server lives here. It may import every layer below.

pub mod admission;
pub mod auth;
pub mod http;
pub mod openai;
pub mod output;
pub mod prometheus;
pub mod server;
pub mod service;
pub mod store;
pub mod tensorboard;
pub mod tls;
