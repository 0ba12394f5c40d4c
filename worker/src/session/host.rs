//! What a worker tells the coordinator about its host at registration.

/// This machine's hostname (`/proc/sys/kernel/hostname`, `$HOSTNAME`, or "localhost").
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Total memory from `/proc/meminfo` (0 when unknown).
pub fn memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| parse_meminfo(&s))
        .unwrap_or(0)
}

fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn meminfo_total_is_read_in_bytes() {
        let text = "MemFree:  10 kB\nMemTotal:       16318412 kB\n";
        assert_eq!(super::parse_meminfo(text), Some(16_318_412 * 1024));
        assert_eq!(super::parse_meminfo("nothing"), None);
    }
}
