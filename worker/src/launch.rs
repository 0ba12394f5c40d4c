//! `accrue-worker --gpus N|all`: one worker process per GPU of a node, as
//! `torchrun --nproc-per-node` users expect (issue 15). The launcher runs N
//! copies of its own command line, child `i` with `LOCAL_RANK=i` and
//! `--device cuda:i`, and every listening port shifted by `i ×`
//! [`PORT_STRIDE`] (collective, health, metrics), so a pod declares one
//! port per process without collisions (7071, 7171, …; 7072, 7172, …).
//! SIGTERM and SIGINT are forwarded to every child (each drains its own
//! step); the launcher exits with the first non-zero exit code among them,
//! else 0. Each child registers with the coordinator on its own: the
//! coordinator sees N workers, as it would N pods.
//!
//! [`child_args`] is the pure part (tested); [`run`] spawns and waits.

/// How far apart the ports of consecutive local ranks are.
pub const PORT_STRIDE: u16 = 100;

/// Flags whose `host:port` (or `:port`) value is shifted per child.
pub const PORT_FLAGS: [&str; 6] = [
    "--collective-listen",
    "--collective-advertise",
    "--relay-listen",
    "--relay-advertise",
    "--health-listen",
    "--metrics-listen",
];

/// The environment variables of the [`PORT_FLAGS`] that have one: the
/// launcher turns them into flags (shifted) and clears them for children.
const PORT_ENVS: [(&str, &str); 5] = [
    ("--collective-advertise", "ACCRUE_COLLECTIVE_ADVERTISE"),
    ("--relay-listen", "ACCRUE_RELAY_LISTEN"),
    ("--relay-advertise", "ACCRUE_RELAY_ADVERTISE"),
    ("--health-listen", "ACCRUE_HEALTH_LISTEN"),
    ("--metrics-listen", "ACCRUE_WORKER_METRICS_LISTEN"),
];

/// `--gpus`: how many local workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gpus {
    /// Every GPU visible to this process.
    All,
    Count(usize),
}

impl std::str::FromStr for Gpus {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(Gpus::All),
            n => match n.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Gpus::Count(n)),
                _ => Err(format!(
                    "--gpus {n:?}: expected all or a count of at least 1"
                )),
            },
        }
    }
}

/// `addr` with its port moved up by `by` (port 0, "any free port", and a
/// bare host stay as they are).
pub fn shift_port(addr: &str, by: u16) -> Result<String, String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Ok(addr.to_string());
    };
    // An IPv6 literal without a port (`[::1]`, `::1`) has no port to shift.
    if host.contains(':') && !host.ends_with(']') {
        return Ok(addr.to_string());
    }
    let p: u16 = port
        .parse()
        .map_err(|_| format!("{addr:?}: the port is not a number"))?;
    if p == 0 {
        return Ok(addr.to_string());
    }
    let shifted = p
        .checked_add(by)
        .ok_or_else(|| format!("{addr:?}: port {p} + {by} is past 65535"))?;
    Ok(format!("{host}:{shifted}"))
}

/// The command line of local worker `local_rank`, from the launcher's own
/// arguments (without the program name): `--gpus` removed, each of
/// [`PORT_FLAGS`] shifted, `--device cuda:<local_rank>` set.
pub fn child_args(args: &[String], local_rank: usize) -> Result<Vec<String>, String> {
    let by = u16::try_from(local_rank)
        .ok()
        .and_then(|r| r.checked_mul(PORT_STRIDE))
        .ok_or_else(|| {
            format!("local rank {local_rank}: too many processes for the port stride")
        })?;
    let mut out = Vec::with_capacity(args.len() + 2);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let takes_value = flag == "--gpus" || flag == "--device" || PORT_FLAGS.contains(&flag);
        if !takes_value {
            out.push(a.clone());
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))?,
        };
        if PORT_FLAGS.contains(&flag) {
            out.push(flag.to_string());
            out.push(shift_port(&value, by)?);
        }
        // --gpus and --device are the launcher's: dropped, set below.
    }
    out.push("--device".into());
    out.push(format!("cuda:{local_rank}"));
    Ok(out)
}

/// The number of local workers `gpus` asks for on this machine.
pub fn count(gpus: Gpus) -> Result<usize, String> {
    let visible = crate::device::probe().visible;
    match gpus {
        Gpus::All if visible == 0 => Err("--gpus all: no GPU visible to libtorch".into()),
        Gpus::All => Ok(visible),
        Gpus::Count(n) if n > visible => Err(format!("--gpus {n}: {visible} GPU(s) visible")),
        Gpus::Count(n) => Ok(n),
    }
}

/// Runs `n` local workers (this executable with [`child_args`]) and waits
/// for all of them, forwarding SIGTERM/SIGINT; the first non-zero exit
/// code (by local rank), else 0.
pub async fn run(n: usize) -> anyhow::Result<u8> {
    use tokio::signal::unix::{signal, SignalKind};

    let exe = std::env::current_exe()?;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    for (flag, env) in PORT_ENVS {
        let given = args
            .iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")));
        if let (false, Ok(v)) = (given, std::env::var(env)) {
            args.extend([flag.to_string(), v]);
        }
    }
    let mut children = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = tokio::process::Command::new(&exe);
        for (_, env) in PORT_ENVS {
            cmd.env_remove(env);
        }
        let child = cmd
            .args(child_args(&args, rank).map_err(anyhow::Error::msg)?)
            .env_remove("ACCRUE_DEVICE")
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .kill_on_drop(true)
            .spawn()?;
        tracing::info!(local_rank = rank, pid = child.id(), "local worker started");
        children.push(child);
    }
    let pids: Vec<i32> = children
        .iter()
        .filter_map(|c| c.id())
        .filter_map(|p| i32::try_from(p).ok())
        .collect();
    let (mut term, mut int) = (
        signal(SignalKind::terminate())?,
        signal(SignalKind::interrupt())?,
    );
    let forward = async move {
        loop {
            let sig = tokio::select! {
                _ = term.recv() => libc::SIGTERM,
                _ = int.recv() => libc::SIGINT,
            };
            for &pid in &pids {
                // SAFETY: plain kill(2) of our own children; a child that
                // already exited makes it fail harmlessly.
                unsafe { libc::kill(pid, sig) };
            }
        }
    };
    let wait_all = async {
        let mut code = 0u8;
        for (rank, c) in children.iter_mut().enumerate() {
            let status = c.wait().await?;
            tracing::info!(local_rank = rank, %status, "local worker exited");
            if code == 0 && !status.success() {
                code = status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1));
            }
        }
        anyhow::Ok(code)
    };
    let code = tokio::select! {
        code = wait_all => code?,
        _ = forward => unreachable!("the forwarding loop never ends"),
    };
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn children_get_their_gpu_and_shifted_ports() {
        let base = args(
            "--coordinator http://c:7070 --gpus all --collective-listen 0.0.0.0:7071 \
             --collective-advertise=10.0.0.5:7071 --health-listen 0.0.0.0:7072 \
             --metrics-listen 0.0.0.0:9091 --device auto --exit-on-release false",
        );
        assert_eq!(
            child_args(&base, 0).unwrap(),
            args(
                "--coordinator http://c:7070 --collective-listen 0.0.0.0:7071 \
                 --collective-advertise 10.0.0.5:7071 --health-listen 0.0.0.0:7072 \
                 --metrics-listen 0.0.0.0:9091 --exit-on-release false --device cuda:0"
            )
        );
        assert_eq!(
            child_args(&base, 3).unwrap(),
            args(
                "--coordinator http://c:7070 --collective-listen 0.0.0.0:7371 \
                 --collective-advertise 10.0.0.5:7371 --health-listen 0.0.0.0:7372 \
                 --metrics-listen 0.0.0.0:9391 --exit-on-release false --device cuda:3"
            )
        );
        // Port 0 and a bare advertised host stay as they are.
        let any = args("--gpus=2 --collective-listen 127.0.0.1:0 --collective-advertise 10.0.0.5");
        assert_eq!(
            child_args(&any, 1).unwrap(),
            args("--collective-listen 127.0.0.1:0 --collective-advertise 10.0.0.5 --device cuda:1")
        );
    }

    #[test]
    fn bad_values_are_named() {
        assert!(child_args(&args("--health-listen"), 1)
            .unwrap_err()
            .contains("--health-listen"));
        assert!(shift_port("h:65500", 100).unwrap_err().contains("65535"));
        assert!(shift_port("h:x", 100).unwrap_err().contains("not a number"));
        assert_eq!(shift_port("[::1]:7071", 100).unwrap(), "[::1]:7171");
        assert_eq!("all".parse::<Gpus>(), Ok(Gpus::All));
        assert_eq!("8".parse::<Gpus>(), Ok(Gpus::Count(8)));
        assert!("0".parse::<Gpus>().is_err());
    }
}
