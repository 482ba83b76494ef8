//! Reloading the config file into a running selector (`selector reload`,
//! SIGHUP), without detaching: the file read again, checked like a start,
//! the tunables rewritten and the groups changed in place
//! ([`crate::datapath::regroup`] says how); a refused reload changes
//! nothing.

use std::{
    net::SocketAddr,
    path::PathBuf,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Result, anyhow, bail};

use crate::{
    config::file::{ConfigFile, Options, RunConfig},
    config::settings::{BackendPlan, Settings},
    datapath::Selector,
    datapath::regroup::{GroupChanges, GroupTable, plan_groups},
};

/// How the last load of the configuration went, as Prometheus reports its
/// own (`selector_config_reload_success`,
/// `selector_config_reload_timestamp_seconds`): the start's load counts as
/// the first, so a fresh agent reports success at its start time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReloadRecord {
    /// Why the last reload was refused; `None` if it applied (or none was
    /// tried since the start).
    pub refused: Option<String>,
    /// When the configuration in force was loaded: the start, or the last
    /// reload that applied.
    pub last_success: SystemTime,
}

impl ReloadRecord {
    pub fn success(&self) -> bool {
        self.refused.is_none()
    }

    /// [`Self::last_success`] in seconds since the Unix epoch.
    pub fn timestamp_seconds(&self) -> f64 {
        self.last_success
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    }

    /// The record after a reload that ended with `outcome`.
    fn after<T>(&self, outcome: &Result<T>, now: SystemTime) -> Self {
        match outcome {
            Ok(_) => Self {
                refused: None,
                last_success: now,
            },
            Err(e) => Self {
                refused: Some(format!("{e:#}")),
                last_success: self.last_success,
            },
        }
    }
}

/// The keys (and flags) a reload cannot change: the attachment and the
/// agent's own loop; changing one needs a restart. Everything else is
/// applied in place. docs/reference/config.md marks exactly these
/// "restart" (its test checks).
pub const RESTART_KEYS: [&str; 9] = [
    "iface",
    "inflight-max",
    "ingress",
    "mark",
    "interval",
    "duration",
    "pin",
    "netns",
    "metrics-addr",
];

/// What the agent needs to reload: where the file is, the flags it was
/// started with (they still win over the file), and the tables.
#[derive(Debug)]
pub struct Reloader {
    path: Option<PathBuf>,
    flags: Options,
    pub table: GroupTable,
    interval: Duration,
    duration: Option<f64>,
    pub quiet: bool,
    pin: Option<PathBuf>,
    metrics_addr: Option<SocketAddr>,
    /// `--netns` as started with.
    pub netns: Option<PathBuf>,
    /// How the last reload went.
    pub record: ReloadRecord,
    /// Whether the agent could send hedges (it had CAP_NET_RAW at start):
    /// if not, a reload leaves the hedging `--resolv-conf` implies off.
    can_hedge: bool,
}

impl Reloader {
    /// `groups`: the tables as attached (`start`'s groups, or the pinned
    /// ones with them applied).
    pub fn new(
        path: Option<PathBuf>,
        flags: Options,
        start: &RunConfig,
        groups: GroupTable,
        can_hedge: bool,
    ) -> Self {
        Self {
            path,
            flags,
            table: groups,
            interval: start.interval,
            duration: start.duration,
            quiet: start.quiet,
            pin: start.pin.clone(),
            metrics_addr: start.metrics_addr,
            netns: start.netns.clone(),
            record: ReloadRecord {
                refused: None,
                last_success: SystemTime::now(),
            },
            can_hedge,
        }
    }

    /// Re-reads the file and applies it to `selector`. On any error nothing
    /// has changed. Returns what is in force now, in one line. The outcome
    /// is kept in [`Self::record`] (without `--config` there is nothing to
    /// reload, and nothing is recorded).
    pub fn reload(&mut self, selector: &mut Selector) -> Result<String> {
        let path = self
            .path
            .clone()
            .ok_or_else(|| anyhow!("the agent was started without --config: nothing to reload"))?;
        let outcome = self.reload_from(path, selector);
        self.record = self.record.after(&outcome, SystemTime::now());
        outcome
    }

    fn reload_from(&mut self, path: PathBuf, selector: &mut Selector) -> Result<String> {
        let mut wanted = ConfigFile::read(&path)?.resolve_with(&self.flags)?;
        if !self.can_hedge
            && let Some(warning) = wanted.without_implied_hedging()
        {
            log::warn!("{warning}");
        }
        self.check_fixed(&selector.settings, &wanted)?;
        let changes = plan_groups(
            &self.table,
            &wanted.settings.groups,
            &wanted.group_names,
            Instant::now(),
        )?;
        let previous = std::mem::replace(&mut selector.settings, wanted.settings);
        if let Err(e) = selector.write_config() {
            selector.settings = previous;
            return Err(e);
        }
        selector.apply_groups(&changes)?;
        self.table = changes.table.clone();
        selector.backends = self.table.backends();
        // Hedge delays for the backends as they are now (new ones had none).
        selector.write_config()?;
        self.quiet = wanted.quiet;
        Ok(format!(
            "reloaded {}: {}, timeout {} ms, grace {} ms; {}",
            path.display(),
            selector.settings_in_force().tunables.describe(),
            selector.settings.timeout.as_millis(),
            selector.settings.grace.as_millis(),
            describe(&changes)
        ))
    }

    /// Refuses changes to what cannot change while attached.
    fn check_fixed(&self, running: &Settings, wanted: &RunConfig) -> Result<()> {
        let new = &wanted.settings;
        let seconds = |d: Option<f64>| d.map_or("none".to_string(), |d| d.to_string());
        let path = |p: &Option<PathBuf>| {
            p.as_ref()
                .map_or("none".into(), |p| p.display().to_string())
        };
        let address = |a: Option<SocketAddr>| a.map_or("none".to_string(), |a| a.to_string());
        let values = [
            (running.iface.clone(), new.iface.clone()),
            (
                running.inflight_max.to_string(),
                new.inflight_max.to_string(),
            ),
            (running.ingress.name().into(), new.ingress.name().into()),
            (
                format!("{:#010x}", running.mark),
                format!("{:#010x}", new.mark),
            ),
            (
                format!("{:?}", self.interval),
                format!("{:?}", wanted.interval),
            ),
            (seconds(self.duration), seconds(wanted.duration)),
            (path(&self.pin), path(&wanted.pin)),
            (path(&self.netns), path(&wanted.netns)),
            (address(self.metrics_addr), address(wanted.metrics_addr)),
        ];
        let fixed: Vec<String> = RESTART_KEYS
            .into_iter()
            .zip(values)
            .filter(|(_, (old, new))| old != new)
            .map(|(key, (old, new))| format!("{key} {old} -> {new}"))
            .collect();
        if !fixed.is_empty() {
            bail!(
                "{} cannot change while the agent runs (restart it to change them)",
                fixed.join(", ")
            );
        }
        Ok(())
    }

    /// Forgets retiring members whose requests are done (see the module doc).
    pub fn retire_finished(&mut self, selector: &mut Selector) -> Result<Vec<SocketAddr>> {
        let linger = selector.settings.timeout + selector.settings.grace;
        selector.retire_finished(&mut self.table, linger, Instant::now())
    }
}

pub(crate) fn describe(changes: &GroupChanges) -> String {
    if changes.is_empty() {
        return "groups unchanged".into();
    }
    let list = |what: &str, backends: &[BackendPlan]| {
        (!backends.is_empty()).then(|| {
            let addrs: Vec<String> = backends.iter().map(|b| b.addr.to_string()).collect();
            format!("{what} {}", addrs.join(" "))
        })
    };
    [
        list("added", &changes.added),
        list("kept again", &changes.restored),
        list("removing (until their requests finish)", &changes.removed),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::new([10, 0, 0, i].into(), 11211)
    }

    fn group(members: &[u8]) -> Vec<SocketAddr> {
        members.iter().map(|i| addr(*i)).collect()
    }

    fn ids(backends: &[BackendPlan]) -> Vec<(u32, SocketAddr)> {
        backends.iter().map(|b| (b.index, b.addr)).collect()
    }

    fn start(groups: &[&[u8]], names: &[Option<&str>]) -> GroupTable {
        let groups: Vec<_> = groups.iter().map(|g| group(g)).collect();
        let names: Vec<_> = names.iter().map(|n| n.map(String::from)).collect();
        GroupTable::from_start(&groups, &names)
    }

    fn reload(
        table: &GroupTable,
        groups: &[&[u8]],
        names: &[Option<&str>],
    ) -> Result<GroupChanges> {
        let groups: Vec<_> = groups.iter().map(|g| group(g)).collect();
        let names: Vec<_> = names.iter().map(|n| n.map(String::from)).collect();
        plan_groups(table, &groups, &names, Instant::now())
    }

    #[test]
    fn the_start_table_numbers_in_order() {
        let t = start(&[&[1, 2], &[3]], &[None, None]);
        assert_eq!(
            ids(&t.backends()),
            vec![(0, addr(1)), (1, addr(2)), (8, addr(3))]
        );
    }

    #[test]
    fn the_same_groups_change_nothing() {
        let t = start(&[&[1, 2, 3]], &[Some("a")]);
        let c = reload(&t, &[&[1, 2, 3]], &[Some("a")]).unwrap();
        assert!(c.is_empty());
        assert_eq!(c.table, t);
    }

    #[test]
    fn kept_members_keep_their_ids_and_added_ones_take_free_positions() {
        let t = start(&[&[1, 2, 3], &[4]], &[None, None]);
        // Member 2 removed, 5 added; the order in the file does not move kept ones.
        let c = reload(&t, &[&[5, 3, 1], &[4]], &[None, None]).unwrap();
        assert_eq!(ids(&c.removed), vec![(1, addr(2))]);
        // Position 1 is still held by the retiring member 2.
        assert_eq!(ids(&c.added), vec![(3, addr(5))]);
        let backends = ids(&c.table.backends());
        assert!(backends.contains(&(0, addr(1))));
        assert!(backends.contains(&(2, addr(3))));
        assert!(backends.contains(&(8, addr(4))));
        assert!(backends.contains(&(1, addr(2))), "retiring, still there");
        assert!(c.table.is_retiring(addr(2)));
        assert!(!c.table.is_retiring(addr(1)));
    }

    #[test]
    fn a_retiring_member_configured_again_is_restored_in_place() {
        let t = start(&[&[1, 2]], &[None]);
        let removed = reload(&t, &[&[1]], &[None]).unwrap();
        let c = reload(&removed.table, &[&[1, 2]], &[None]).unwrap();
        assert_eq!(ids(&c.restored), vec![(1, addr(2))]);
        assert!(c.added.is_empty() && c.removed.is_empty());
        assert_eq!(c.table, t);
    }

    #[test]
    fn groups_match_by_name_then_by_members() {
        let t = start(&[&[1, 2], &[3, 4]], &[Some("a"), None]);
        // Named "a" keeps index 0 with all-new members; the unnamed one is
        // found by member 4 though it now comes first.
        let c = reload(&t, &[&[4], &[5, 6]], &[None, Some("a")]).unwrap();
        let backends = ids(&c.table.backends());
        assert!(backends.contains(&(9, addr(4))), "{backends:?}");
        assert_eq!(ids(&c.added), vec![(2, addr(5)), (3, addr(6))]);
        assert_eq!(
            ids(&c.removed),
            vec![(0, addr(1)), (1, addr(2)), (8, addr(3))]
        );
    }

    #[test]
    fn a_new_group_takes_the_lowest_free_index_and_a_dropped_group_retires() {
        let t = start(&[&[1], &[2], &[3]], &[None, None, None]);
        let c = reload(&t, &[&[1], &[3]], &[None, None]).unwrap();
        assert_eq!(ids(&c.removed), vec![(8, addr(2))]);
        // Group index 1 is held until member 2 retires.
        let c = reload(&c.table, &[&[1], &[3], &[7]], &[None, None, None]).unwrap();
        assert_eq!(ids(&c.added), vec![(24, addr(7))]);
    }

    #[test]
    fn moves_merges_splits_and_full_groups_are_refused() {
        let named = start(&[&[1, 2], &[3]], &[Some("a"), Some("b")]);
        let e = reload(&named, &[&[1], &[3, 2]], &[Some("a"), Some("b")]).unwrap_err();
        assert!(
            e.to_string()
                .contains("backend 10.0.0.2:11211 would move from running group 1 to group 'b'"),
            "{e}"
        );
        let t = start(&[&[1, 2], &[3]], &[None, None]);
        let e = reload(&t, &[&[1], &[3, 2]], &[None, None]).unwrap_err();
        assert!(
            e.to_string()
                .contains("group 2 takes members of running groups 1 and 2"),
            "{e}"
        );
        let e = reload(&t, &[&[1, 3]], &[None]).unwrap_err();
        assert!(
            e.to_string()
                .contains("takes members of running groups 1 and 2"),
            "{e}"
        );
        let e = reload(&t, &[&[1], &[2]], &[None, None]).unwrap_err();
        assert!(
            e.to_string().contains("both continue running group 1"),
            "{e}"
        );
        let full = start(&[&[1, 2, 3, 4, 5, 6, 7, 8]], &[None]);
        let e = reload(&full, &[&[1, 2, 3, 4, 5, 6, 7, 9]], &[None]).unwrap_err();
        assert!(
            e.to_string()
                .contains("no free position for 10.0.0.9:11211"),
            "{e}"
        );
    }

    #[test]
    fn backends_come_in_id_order() {
        let t = start(&[&[1, 2], &[3]], &[None, None]);
        let c = reload(&t, &[&[3, 4], &[1, 2]], &[None, None]).unwrap();
        let order: Vec<u32> = c.table.backends().iter().map(|b| b.index).collect();
        assert_eq!(order, vec![0, 1, 8, 9]);
    }

    #[test]
    fn a_refused_reload_keeps_the_last_success_time() {
        let start = UNIX_EPOCH + Duration::from_secs(1_000);
        let fresh = ReloadRecord {
            refused: None,
            last_success: start,
        };
        assert!(fresh.success());
        assert_eq!(fresh.timestamp_seconds(), 1_000.0);
        let later = start + Duration::from_millis(2_500);
        let refused = fresh.after::<()>(
            &Err(anyhow!("f.toml:3: threshold: must be at least 1")),
            later,
        );
        assert!(!refused.success());
        assert_eq!(refused.timestamp_seconds(), 1_000.0);
        assert_eq!(
            refused.refused.as_deref(),
            Some("f.toml:3: threshold: must be at least 1")
        );
        let applied = refused.after(&Ok(()), later);
        assert_eq!(applied.refused, None);
        assert_eq!(applied.timestamp_seconds(), 1_002.5);
    }
}
