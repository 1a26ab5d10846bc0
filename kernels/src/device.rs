//! Which compute device runs the model: `--device auto|cpu|cuda[:N]|rocm[:N]`.
//!
//! [`Device`] is the parsed flag; [`Device::probe`] says whether it can run here, without
//! panicking on a machine that has no GPU driver (the CUDA and ROCm runtimes are loaded
//! dynamically, so one binary serves every machine). [`Device::resolve`] turns the flag into
//! the device that runs: `auto` is the first GPU that opens, else the CPU; a GPU the user
//! *named* that cannot be opened is a [`KernelError::DeviceUnavailable`] naming the reason,
//! never a quiet fall-back to the CPU (a GPU worker serving at CPU speed is an outage).

use std::fmt;
use std::str::FromStr;

use crate::error::KernelError;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The CPU reference backend.
    #[default]
    Cpu,
    /// The first GPU that opens (CUDA, then ROCm), else the CPU; see [`Device::resolve`].
    Auto,
    /// NVIDIA GPU `N` through the CUDA driver, NVRTC and cuBLAS.
    Cuda(usize),
    /// AMD GPU `N` through HIP and hipRTC.
    Rocm(usize),
}

impl Device {
    /// Whether this names a GPU (`auto` does not, until resolved).
    pub fn is_gpu(&self) -> bool {
        matches!(self, Device::Cuda(_) | Device::Rocm(_))
    }

    /// Checks that the device can be opened here: the backend is compiled in, its runtime
    /// library loads, and the ordinal exists. Never panics.
    pub fn probe(&self) -> Result<(), KernelError> {
        match *self {
            Device::Cpu | Device::Auto => Ok(()),
            Device::Cuda(ordinal) => probe_cuda(ordinal),
            Device::Rocm(ordinal) => probe_rocm(ordinal),
        }
    }

    /// The device that runs: a named device if it probes (else the probe's error, which
    /// names the reason), `auto` as `cuda:0` if it probes, else `rocm:0`, else the CPU.
    pub fn resolve(self) -> Result<Device, KernelError> {
        match self {
            Device::Auto => Ok([Device::Cuda(0), Device::Rocm(0)]
                .into_iter()
                .find(|d| d.probe().is_ok())
                .unwrap_or(Device::Cpu)),
            named => named.probe().map(|()| named),
        }
    }
}

#[cfg(feature = "cuda")]
fn probe_cuda(ordinal: usize) -> Result<(), KernelError> {
    crate::cuda::context::probe(ordinal)
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda(ordinal: usize) -> Result<(), KernelError> {
    Err(KernelError::DeviceUnavailable {
        device: Device::Cuda(ordinal).to_string(),
        reason: "this binary was built without the `cuda` feature".into(),
    })
}

#[cfg(feature = "rocm")]
fn probe_rocm(ordinal: usize) -> Result<(), KernelError> {
    crate::rocm::probe(ordinal)
}

#[cfg(not(feature = "rocm"))]
fn probe_rocm(ordinal: usize) -> Result<(), KernelError> {
    Err(KernelError::DeviceUnavailable {
        device: Device::Rocm(ordinal).to_string(),
        reason: "this binary was built without the `rocm` feature".into(),
    })
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Auto => write!(f, "auto"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Rocm(n) => write!(f, "rocm:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = KernelError;

    /// `auto`, `cpu`, `cuda`, `cuda:N`, `rocm`, `rocm:N` (case-insensitive; no ordinal means 0).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || KernelError::InvalidDevice {
            value: s.to_string(),
        };
        let lower = s.trim().to_ascii_lowercase();
        let (kind, ordinal) = match lower.split_once(':') {
            Some((k, n)) => (k, Some(n.parse::<usize>().map_err(|_| bad())?)),
            None => (lower.as_str(), None),
        };
        match (kind, ordinal) {
            ("cpu", None) => Ok(Device::Cpu),
            ("auto", None) => Ok(Device::Auto),
            ("cuda", n) => Ok(Device::Cuda(n.unwrap_or(0))),
            ("rocm" | "hip", n) => Ok(Device::Rocm(n.unwrap_or(0))),
            _ => Err(bad()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (text, dev) in [
            ("cpu", Device::Cpu),
            ("CPU", Device::Cpu),
            ("auto", Device::Auto),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
            ("rocm", Device::Rocm(0)),
            ("rocm:1", Device::Rocm(1)),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(dev), "{text}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!("cuda:2".parse::<Device>(), Ok(Device::Cuda(2)));
        for bad in ["", "gpu", "cuda:", "cuda:x", "cpu:0", "cuda:-1", "auto:0"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_always_probes_and_gpus_never_panic() {
        assert_eq!(Device::Cpu.probe(), Ok(()));
        // On a machine without a GPU these are errors, never panics; with one they may succeed.
        let _ = Device::Cuda(0).probe();
        let _ = Device::Rocm(0).probe();
        // A named device that cannot open is an error naming it, not the CPU.
        let err = Device::Cuda(usize::MAX).resolve().expect_err("no such GPU");
        assert!(
            err.to_string().contains(&format!("cuda:{}", usize::MAX)),
            "{err}"
        );
        // `auto` always resolves, to a concrete device.
        let auto = Device::Auto.resolve().expect("auto resolves");
        assert_ne!(auto, Device::Auto);
        assert_eq!(Device::Cpu.resolve(), Ok(Device::Cpu));
    }
}
