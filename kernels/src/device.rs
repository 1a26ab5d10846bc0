//! Which compute device runs the model: `--device cpu|cuda[:N]|rocm[:N]`.
//!
//! [`Device`] is the parsed flag; [`Device::probe`] says whether it can run here, without
//! panicking on a machine that has no GPU driver (the CUDA and ROCm runtimes are loaded
//! dynamically, so one binary serves every machine). Callers that may fall back to the CPU
//! log the [`KernelError::DeviceUnavailable`] reason and carry on with [`Device::Cpu`].

use std::fmt;
use std::str::FromStr;

use crate::error::KernelError;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The CPU reference backend.
    #[default]
    Cpu,
    /// NVIDIA GPU `N` through the CUDA driver, NVRTC and cuBLAS.
    Cuda(usize),
    /// AMD GPU `N` through HIP and hipRTC.
    Rocm(usize),
}

impl Device {
    /// Whether this is a GPU.
    pub fn is_gpu(&self) -> bool {
        !matches!(self, Device::Cpu)
    }

    /// Checks that the device can be opened here: the backend is compiled in, its runtime
    /// library loads, and the ordinal exists. Never panics.
    pub fn probe(&self) -> Result<(), KernelError> {
        match *self {
            Device::Cpu => Ok(()),
            Device::Cuda(ordinal) => probe_cuda(ordinal),
            Device::Rocm(ordinal) => probe_rocm(ordinal),
        }
    }

    /// `self` if [`Self::probe`] succeeds, otherwise [`Device::Cpu`] and the reason.
    pub fn or_cpu(self) -> (Device, Option<KernelError>) {
        match self.probe() {
            Ok(()) => (self, None),
            Err(e) => (Device::Cpu, Some(e)),
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
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Rocm(n) => write!(f, "rocm:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = KernelError;

    /// `cpu`, `cuda`, `cuda:N`, `rocm`, `rocm:N` (case-insensitive; no ordinal means 0).
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
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
            ("rocm", Device::Rocm(0)),
            ("rocm:1", Device::Rocm(1)),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(dev), "{text}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!("cuda:2".parse::<Device>(), Ok(Device::Cuda(2)));
        for bad in ["", "gpu", "cuda:", "cuda:x", "cpu:0", "cuda:-1"] {
            assert!(bad.parse::<Device>().is_err(), "{bad}");
        }
    }

    #[test]
    fn cpu_always_probes_and_gpus_never_panic() {
        assert_eq!(Device::Cpu.probe(), Ok(()));
        // On a machine without a GPU these are errors, never panics; with one they may succeed.
        let _ = Device::Cuda(0).probe();
        let _ = Device::Rocm(0).probe();
        let (dev, why) = Device::Cuda(usize::MAX).or_cpu();
        assert_eq!(dev, Device::Cpu);
        assert!(why.is_some());
    }
}
