//! Which device a worker process trains on (`--device`, issue 15), and
//! what it tells the coordinator about it at registration.
//!
//! One worker process per device, as `torchrun --nproc-per-node` users
//! expect: `--device auto` takes `LOCAL_RANK` when a launcher set it (the
//! image's `accrue-launch`, torchrun, a k8s pod running one process per
//! GPU), else the first visible GPU no process computes on, else the CPU;
//! `cuda` is that choice among GPUs only; `cuda:N` and `cpu` are taken as
//! given. Indices are CUDA's: ordinals among the GPUs `CUDA_VISIBLE_DEVICES`
//! leaves visible.
//!
//! The decision ([`choose`]) is a pure function of what was asked and a
//! [`Gpus`] snapshot; [`probe`] reads that snapshot from libtorch and
//! `nvidia-smi` (which lists physical GPUs, so its rows are mapped through
//! `CUDA_VISIBLE_DEVICES`).

use std::fmt;
use std::str::FromStr;

use tch::Device;

/// What `--device` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRequest {
    /// `LOCAL_RANK`, else the first free visible GPU, else the CPU.
    Auto,
    Cpu,
    /// `cuda`: like `Auto` but a GPU is required.
    AnyCuda,
    /// `cuda:N`.
    Cuda(usize),
}

impl FromStr for DeviceRequest {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s.trim() {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::AnyCuda),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| DeviceError::Parse(other.to_string())),
        }
    }
}

/// Why a device cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("--device {0:?}: expected auto, cpu, cuda or cuda:N")]
    Parse(String),
    #[error("LOCAL_RANK {0:?} is not a number")]
    LocalRank(String),
    #[error("{what} asks for cuda:{ordinal}, but {visible} GPU(s) are visible{hint}")]
    NoSuchGpu {
        what: String,
        ordinal: usize,
        visible: usize,
        hint: &'static str,
    },
}

/// The visible GPUs, by CUDA ordinal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gpus {
    /// GPUs libtorch can use (0 without CUDA).
    pub visible: usize,
    /// `busy[i]`: some process computes on visible GPU `i` (unknown GPUs
    /// count as free).
    pub busy: Vec<bool>,
}

/// The device chosen and why (logged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub device: Device,
    pub why: &'static str,
}

fn cpu_hint(visible: usize) -> &'static str {
    if visible == 0 {
        " (libtorch sees no GPU: no driver, a CPU-only libtorch, or CUDA_VISIBLE_DEVICES empty)"
    } else {
        ""
    }
}

/// The device for `req` on a machine with `gpus`; `local_rank` is the
/// `LOCAL_RANK` environment variable, if set.
pub fn choose(
    req: DeviceRequest,
    local_rank: Option<&str>,
    gpus: &Gpus,
) -> Result<Choice, DeviceError> {
    let gpu = |ordinal: usize, what: String, why| {
        if ordinal < gpus.visible {
            Ok(Choice {
                device: Device::Cuda(ordinal),
                why,
            })
        } else {
            Err(DeviceError::NoSuchGpu {
                what,
                ordinal,
                visible: gpus.visible,
                hint: cpu_hint(gpus.visible),
            })
        }
    };
    match req {
        DeviceRequest::Cpu => Ok(Choice {
            device: Device::Cpu,
            why: "--device cpu",
        }),
        DeviceRequest::Cuda(n) => gpu(n, format!("--device cuda:{n}"), "--device cuda:N"),
        DeviceRequest::Auto | DeviceRequest::AnyCuda => {
            if let Some(lr) = local_rank.map(str::trim).filter(|s| !s.is_empty()) {
                let n: usize = lr
                    .parse()
                    .map_err(|_| DeviceError::LocalRank(lr.to_string()))?;
                if gpus.visible > 0 || req == DeviceRequest::AnyCuda {
                    return gpu(n, format!("LOCAL_RANK={n}"), "LOCAL_RANK");
                }
            }
            if let Some(free) =
                (0..gpus.visible).find(|&i| !gpus.busy.get(i).copied().unwrap_or(false))
            {
                return Ok(Choice {
                    device: Device::Cuda(free),
                    why: "the first free visible GPU",
                });
            }
            match (req, gpus.visible) {
                (DeviceRequest::AnyCuda, 0) => gpu(0, "--device cuda".into(), ""),
                (DeviceRequest::AnyCuda, _) => Ok(Choice {
                    device: Device::Cuda(0),
                    why: "every visible GPU is busy: sharing GPU 0",
                }),
                _ if gpus.visible > 0 => Ok(Choice {
                    device: Device::Cpu,
                    why: "every visible GPU is busy: training on the CPU",
                }),
                _ => Ok(Choice {
                    device: Device::Cpu,
                    why: "no visible GPU",
                }),
            }
        }
    }
}

/// `cpu` or `cuda:N`, as registration and logs name a device.
pub fn label(d: Device) -> String {
    match d {
        Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".into(),
    }
}

/// A GPU as `nvidia-smi` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmiGpu {
    /// Physical index.
    pub index: usize,
    pub uuid: String,
    pub name: String,
    pub memory_bytes: u64,
}

/// Rows of `nvidia-smi --query-gpu=index,uuid,name,memory.total
/// --format=csv,noheader,nounits` (memory in MiB).
pub fn parse_smi_gpus(text: &str) -> Vec<SmiGpu> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            let [index, uuid, name, mib] = f.as_slice() else {
                return None;
            };
            Some(SmiGpu {
                index: index.parse().ok()?,
                uuid: uuid.to_string(),
                name: name.to_string(),
                memory_bytes: mib.parse::<u64>().ok()? << 20,
            })
        })
        .collect()
}

/// The physical GPUs behind CUDA ordinals 0, 1, … given
/// `CUDA_VISIBLE_DEVICES` (indices or UUIDs, as CUDA reads it: up to the
/// first entry that names no GPU); all of `gpus` in order when unset.
pub fn visible_gpus<'a>(cuda_visible_devices: Option<&str>, gpus: &'a [SmiGpu]) -> Vec<&'a SmiGpu> {
    let Some(list) = cuda_visible_devices else {
        return gpus.iter().collect();
    };
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim) {
        let found = match entry.parse::<usize>() {
            Ok(i) => gpus.iter().find(|g| g.index == i),
            Err(_) if !entry.is_empty() => gpus.iter().find(|g| g.uuid.starts_with(entry)),
            Err(_) => None,
        };
        match found {
            Some(g) if !out.contains(&g) => out.push(g),
            _ => break,
        }
    }
    out
}

fn nvidia_smi(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("nvidia-smi")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The visible GPUs as `nvidia-smi` describes them, by CUDA ordinal (empty
/// without `nvidia-smi`).
fn smi_visible() -> Vec<SmiGpu> {
    let Some(text) = nvidia_smi(&[
        "--query-gpu=index,uuid,name,memory.total",
        "--format=csv,noheader,nounits",
    ]) else {
        return Vec::new();
    };
    let all = parse_smi_gpus(&text);
    let env = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    visible_gpus(env.as_deref(), &all)
        .into_iter()
        .cloned()
        .collect()
}

/// A small number naming the physical GPU behind `device` (a hash of its
/// `nvidia-smi` UUID, below 2^24 so a float32 carries it exactly; never
/// 0), or 0 when unknown (a CPU device, no `nvidia-smi`). Two ranks on
/// one GPU cannot share an NCCL communicator ("duplicate GPU"): the
/// collective's backend choice compares these.
pub fn gpu_identity(device: Device) -> u32 {
    let Device::Cuda(ordinal) = device else {
        return 0;
    };
    smi_visible()
        .get(ordinal)
        .map_or(0, |g| uuid_identity(&g.uuid))
}

fn uuid_identity(uuid: &str) -> u32 {
    let h = uuid.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    (h & 0x00ff_ffff).max(1)
}

/// This machine's GPUs as libtorch sees them, with the busy ones marked
/// from `nvidia-smi`'s compute processes.
pub fn probe() -> Gpus {
    let visible = if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    };
    if visible == 0 {
        return Gpus::default();
    }
    let busy_uuids =
        nvidia_smi(&["--query-compute-apps=gpu_uuid", "--format=csv,noheader"]).unwrap_or_default();
    let busy_uuids: Vec<&str> = busy_uuids.lines().map(str::trim).collect();
    let smi = smi_visible();
    let busy = (0..visible)
        .map(|i| {
            smi.get(i)
                .is_some_and(|g| busy_uuids.contains(&g.uuid.as_str()))
        })
        .collect();
    Gpus { visible, busy }
}

/// What registration says about a device.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceInfo {
    /// `cpu` or `cuda:N`.
    pub label: String,
    /// The GPU's name (empty on CPU or when unknown).
    pub gpu_name: String,
    /// The GPU's memory (0 on CPU or when unknown).
    pub gpu_memory_bytes: u64,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpu_name.is_empty() {
            write!(f, "{}", self.label)
        } else {
            write!(f, "{} ({})", self.label, self.gpu_name)
        }
    }
}

/// Describes `device` (a GPU's name and memory from `nvidia-smi`, or from
/// the CUDA driver when built with `cuda`).
pub fn describe(device: Device) -> DeviceInfo {
    let label = label(device);
    let Device::Cuda(n) = device else {
        return DeviceInfo {
            label,
            ..Default::default()
        };
    };
    let (gpu_name, gpu_memory_bytes) = match smi_visible().get(n) {
        Some(g) => (g.name.clone(), g.memory_bytes),
        None => driver_description(n).unwrap_or_default(),
    };
    DeviceInfo {
        label,
        gpu_name,
        gpu_memory_bytes,
    }
}

#[cfg(feature = "cuda")]
fn driver_description(ordinal: usize) -> Option<(String, u64)> {
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    Some((ctx.name().ok()?, ctx.total_mem().ok()? as u64))
}

#[cfg(not(feature = "cuda"))]
fn driver_description(_ordinal: usize) -> Option<(String, u64)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_identities_fit_a_float_and_tell_gpus_apart() {
        let a = uuid_identity("GPU-6a3b1f2c-0f4e-11ee-be56-0242ac120002");
        let b = uuid_identity("GPU-6a3b1f2c-0f4e-11ee-be56-0242ac120003");
        assert_ne!(a, b);
        for id in [a, b, uuid_identity("")] {
            assert!(id > 0 && id < 1 << 24);
            assert_eq!(id as f32 as u32, id, "exact in float32");
        }
        assert_eq!(gpu_identity(Device::Cpu), 0);
    }

    fn gpus(visible: usize, busy: &[usize]) -> Gpus {
        Gpus {
            visible,
            busy: (0..visible).map(|i| busy.contains(&i)).collect(),
        }
    }

    fn pick(req: &str, local_rank: Option<&str>, g: &Gpus) -> Result<Device, DeviceError> {
        choose(req.parse()?, local_rank, g).map(|c| c.device)
    }

    #[test]
    fn auto_takes_local_rank_then_the_first_free_gpu_then_the_cpu() {
        let eight = gpus(8, &[0, 1]);
        assert_eq!(pick("auto", Some("5"), &eight), Ok(Device::Cuda(5)));
        // LOCAL_RANK wins even over a busy GPU: the launcher decided.
        assert_eq!(pick("auto", Some("1"), &eight), Ok(Device::Cuda(1)));
        assert_eq!(pick("auto", None, &eight), Ok(Device::Cuda(2)));
        assert_eq!(pick("auto", Some(""), &eight), Ok(Device::Cuda(2)));
        assert_eq!(pick("auto", None, &gpus(2, &[0, 1])), Ok(Device::Cpu));
        assert_eq!(pick("auto", None, &gpus(0, &[])), Ok(Device::Cpu));
        // A launcher's LOCAL_RANK on a machine without GPUs: the CPU.
        assert_eq!(pick("auto", Some("3"), &gpus(0, &[])), Ok(Device::Cpu));
        let e = pick("auto", Some("9"), &eight).unwrap_err();
        assert!(
            matches!(
                e,
                DeviceError::NoSuchGpu {
                    ordinal: 9,
                    visible: 8,
                    ..
                }
            ),
            "{e}"
        );
        assert!(matches!(
            pick("auto", Some("x"), &eight),
            Err(DeviceError::LocalRank(_))
        ));
    }

    #[test]
    fn explicit_requests_are_checked_against_the_visible_gpus() {
        let two = gpus(2, &[0]);
        assert_eq!(pick("cpu", Some("1"), &two), Ok(Device::Cpu));
        assert_eq!(pick("cuda:0", None, &two), Ok(Device::Cuda(0)));
        assert_eq!(pick("cuda", None, &two), Ok(Device::Cuda(1)));
        assert_eq!(pick("cuda", None, &gpus(2, &[0, 1])), Ok(Device::Cuda(0)));
        let e = pick("cuda:2", None, &two).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--device cuda:2 asks for cuda:2, but 2 GPU(s) are visible"
        );
        let e = pick("cuda", None, &gpus(0, &[])).unwrap_err();
        assert!(e.to_string().contains("libtorch sees no GPU"), "{e}");
        for bad in ["gpu:1", "cuda:", "cuda:-1", "tpu"] {
            assert!(
                matches!(bad.parse::<DeviceRequest>(), Err(DeviceError::Parse(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn nvidia_smi_rows_map_through_cuda_visible_devices() {
        let text = "0, GPU-aaaa, NVIDIA H100 80GB HBM3, 81559\n\
                    1, GPU-bbbb, NVIDIA H100 80GB HBM3, 81559\n\
                    2, GPU-cccc, NVIDIA A100-SXM4-40GB, 40960\n";
        let all = parse_smi_gpus(text);
        assert_eq!(all.len(), 3);
        assert_eq!(all[2].memory_bytes, 40960 << 20);
        let idx = |v: Vec<&SmiGpu>| v.iter().map(|g| g.index).collect::<Vec<_>>();
        assert_eq!(idx(visible_gpus(None, &all)), vec![0, 1, 2]);
        assert_eq!(idx(visible_gpus(Some("2,0"), &all)), vec![2, 0]);
        assert_eq!(idx(visible_gpus(Some("GPU-bbbb,GPU-aa"), &all)), vec![1, 0]);
        // CUDA stops at the first entry that names no GPU.
        assert_eq!(idx(visible_gpus(Some("1,7,0"), &all)), vec![1]);
        assert!(visible_gpus(Some(""), &all).is_empty());
        assert!(visible_gpus(Some("-1"), &all).is_empty());
        assert!(parse_smi_gpus("garbage\n").is_empty());
    }
}
