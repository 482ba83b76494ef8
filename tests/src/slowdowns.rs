//! Slowdowns as production has them, for the tests and the benchmark: a
//! replica throttled at its CPU limit (a CFS quota with a busy process
//! beside it, as a pod at `resources.limits.cpu`), and the primary picked
//! at random per flow by kube-proxy's iptables rules for a Service.

use std::{
    fs,
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};

use crate::netns::{Namespace, pids_in, unique_tag};

/// Where cgroup v1's cpu controller is mounted on this machine.
const CPU_CGROUPS: &str = "/sys/fs/cgroup/cpu";
/// The CFS period: the kernel's default, 100 ms.
pub const CFS_PERIOD: Duration = Duration::from_millis(100);

/// A CPU cgroup holding every process of a replica's namespace and a busy
/// loop, its CFS quota `percent` of one CPU per period: the replica runs
/// for a share of each period and is throttled for the rest, ten stalls a
/// second. Dropping it moves the processes back and removes the cgroup.
pub struct CpuThrottle {
    dir: PathBuf,
    busy: Child,
    pids: Vec<i32>,
}

impl CpuThrottle {
    /// Throttles the processes of `ns` (at least one must run) at `percent`.
    pub fn start(ns: &Namespace, percent: u32) -> Result<Self> {
        ensure!(
            (1..=100).contains(&percent),
            "a quota of {percent}% of a CPU"
        );
        let pids = pids_in(&ns.name);
        ensure!(!pids.is_empty(), "no process in {} to throttle", ns.name);
        ensure!(
            PathBuf::from(CPU_CGROUPS).join("cpu.cfs_quota_us").exists(),
            "no cgroup v1 cpu controller with CFS bandwidth at {CPU_CGROUPS}"
        );
        let dir = PathBuf::from(CPU_CGROUPS).join(format!("selector-throttle-{}", unique_tag()));
        fs::create_dir(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let busy = Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .context("starting the busy loop")?;
        let mut throttle = Self { dir, busy, pids };
        throttle.write("cpu.cfs_period_us", CFS_PERIOD.as_micros() as u64 as i64)?;
        throttle.set(percent)?;
        let mut members = throttle.pids.clone();
        members.push(throttle.busy.id() as i32);
        for pid in &members {
            fs::write(throttle.dir.join("cgroup.procs"), pid.to_string())
                .with_context(|| format!("moving {pid} into {}", throttle.dir.display()))?;
        }
        throttle.pids = members;
        Ok(throttle)
    }

    /// Changes the quota to `percent` of a CPU (0: no quota, the replica
    /// well again; the busy loop then shares the CPUs as any process).
    pub fn set(&mut self, percent: u32) -> Result<()> {
        let quota = if percent == 0 {
            -1
        } else {
            (CFS_PERIOD.as_micros() as u64 * u64::from(percent) / 100) as i64
        };
        self.write("cpu.cfs_quota_us", quota)
    }

    /// The replica well again: no quota, and the busy loop gone (left
    /// running it would still share the CPUs with the replica).
    pub fn release(&mut self) -> Result<()> {
        self.set(0)?;
        let _ = self.busy.kill();
        let _ = self.busy.wait();
        Ok(())
    }

    /// Periods in which the cgroup was throttled so far.
    pub fn throttled_periods(&self) -> Result<u64> {
        let text = fs::read_to_string(self.dir.join("cpu.stat"))?;
        text.lines()
            .find_map(|l| l.strip_prefix("nr_throttled "))
            .context("cpu.stat without nr_throttled")?
            .trim()
            .parse()
            .context("nr_throttled")
    }

    fn write(&self, file: &str, value: i64) -> Result<()> {
        fs::write(self.dir.join(file), value.to_string())
            .with_context(|| format!("writing {value} to {}/{file}", self.dir.display()))
    }
}

impl Drop for CpuThrottle {
    fn drop(&mut self) {
        let _ = self.busy.kill();
        let _ = self.busy.wait();
        let root = PathBuf::from(CPU_CGROUPS).join("cgroup.procs");
        for pid in &self.pids {
            let _ = fs::write(&root, pid.to_string());
        }
        // Empty now (a process that exited meanwhile left it on its own).
        let _ = fs::remove_dir(&self.dir);
    }
}

/// A Service's virtual address in the client's namespace as kube-proxy's
/// iptables mode makes it: each new flow to `vip:port` is DNATed to one
/// of the endpoints at random (`-m statistic --mode random`, probabilities
/// 1/n, 1/(n-1), ... as kube-proxy writes them). The rules go with the
/// namespace.
pub fn install_kube_proxy(
    client: &Namespace,
    iface: &str,
    vip: Ipv4Addr,
    port: u16,
    endpoints: &[Ipv4Addr],
) -> Result<()> {
    if endpoints.is_empty() {
        bail!("a Service with no endpoints");
    }
    let chain = "KUBE-SVC-SELECTOR";
    let run = |args: &[&str]| -> Result<()> {
        let out = client.exec("iptables", args)?;
        ensure!(
            out.status.success(),
            "iptables {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    };
    // The VIP is no host: a route gets it out of the interface, where the
    // DNAT has already replaced it.
    let route = client.exec("ip", &["route", "add", &format!("{vip}/32"), "dev", iface])?;
    ensure!(route.status.success(), "routing the Service address");
    run(&["-t", "nat", "-N", chain])?;
    let (vip, port) = (vip.to_string(), port.to_string());
    run(&[
        "-t", "nat", "-A", "OUTPUT", "-d", &vip, "-p", "udp", "--dport", &port, "-j", chain,
    ])?;
    let n = endpoints.len();
    for (i, e) in endpoints.iter().enumerate() {
        let to = format!("{e}:{port}");
        let probability = format!("{:.5}", 1.0 / (n - i) as f64);
        let mut args = vec!["-t", "nat", "-A", chain, "-p", "udp"];
        if i + 1 < n {
            args.extend([
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &probability,
            ]);
        }
        args.extend(["-j", "DNAT", "--to-destination", &to]);
        run(&args)?;
    }
    Ok(())
}
