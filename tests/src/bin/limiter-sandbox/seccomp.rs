//! The seccomp filters `limiter-sandbox` builds from a unit's directives, each returning what
//! systemd's returns.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    str::FromStr as _,
};

use anyhow::{Context as _, bail, ensure};
use seccompiler::{
    SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter, SeccompRule,
    TargetArch,
};
use syscalls::Sysno;

fn nr(name: &str) -> anyhow::Result<i64> {
    Sysno::from_str(name).map(|s| i64::from(s.id())).map_err(|()| anyhow::anyhow!("no system call {name} here"))
}

fn errno(e: i32) -> SeccompAction {
    SeccompAction::Errno(e as u32)
}

fn cond(arg: u8, len: Len, op: Op, value: u64) -> anyhow::Result<Cond> {
    Ok(Cond::new(arg, len, op, value)?)
}

fn rule(conditions: Vec<Cond>) -> anyhow::Result<SeccompRule> {
    Ok(SeccompRule::new(conditions)?)
}

/// A filter that returns `action` when one of `rules` matches, and allows everything else.
fn deny(rules: Vec<(i64, Vec<SeccompRule>)>, action: SeccompAction, arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for (nr, mut r) in rules {
        map.entry(nr).or_default().append(&mut r);
    }
    Ok(SeccompFilter::new(map, SeccompAction::Allow, action, arch)?)
}

/// socket(2) with a family outside the list (or inside it, for `~`) fails with EAFNOSUPPORT.
pub(crate) fn address_families(value: &str, arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let (invert, list) = match value.strip_prefix('~') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let families = list
        .split_whitespace()
        .map(|name| {
            Ok(match name {
                "AF_UNIX" | "AF_LOCAL" => libc::AF_UNIX,
                "AF_INET" => libc::AF_INET,
                "AF_INET6" => libc::AF_INET6,
                "AF_NETLINK" => libc::AF_NETLINK,
                "AF_PACKET" => libc::AF_PACKET,
                "AF_XDP" => libc::AF_XDP,
                _ => bail!("RestrictAddressFamilies: {name} is not known here"),
            } as u64)
        })
        .collect::<anyhow::Result<Vec<u64>>>()?;
    let socket = nr("socket")?;
    let rules = if invert {
        families.iter().map(|&f| rule(vec![cond(0, Len::Dword, Op::Eq, f)?])).collect::<anyhow::Result<_>>()?
    } else {
        vec![rule(families.iter().map(|&f| cond(0, Len::Dword, Op::Ne, f)).collect::<anyhow::Result<_>>()?)?]
    };
    deny(vec![(socket, rules)], errno(libc::EAFNOSUPPORT), arch)
}

/// unshare(2), setns(2) and clone(2) with any CLONE_NEW* flag fail (EPERM); clone3(2), whose
/// flags a filter cannot read, fails with ENOSYS, so that libc falls back to clone(2).
pub(crate) fn restrict_namespaces(arch: TargetArch) -> anyhow::Result<Vec<SeccompFilter>> {
    let flags = [
        libc::CLONE_NEWNS,
        libc::CLONE_NEWCGROUP,
        libc::CLONE_NEWUTS,
        libc::CLONE_NEWIPC,
        libc::CLONE_NEWUSER,
        libc::CLONE_NEWPID,
        libc::CLONE_NEWNET,
        0x80, // CLONE_NEWTIME
    ];
    let any_flag = |arg: u8| -> anyhow::Result<Vec<SeccompRule>> {
        flags.iter().map(|&f| rule(vec![cond(arg, Len::Qword, Op::MaskedEq(f as u64), f as u64)?])).collect()
    };
    // clone(2)'s flags are its first argument on x86_64 and aarch64.
    let namespaces = deny(
        vec![(nr("unshare")?, any_flag(0)?), (nr("clone")?, any_flag(0)?), (nr("setns")?, vec![])],
        errno(libc::EPERM),
        arch,
    )?;
    let clone3 = deny(vec![(nr("clone3")?, vec![])], errno(libc::ENOSYS), arch)?;
    Ok(vec![namespaces, clone3])
}

/// No mapping both writable and executable, no memory made executable later.
pub(crate) fn deny_write_execute(arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let (w, x) = (libc::PROT_WRITE as u64, libc::PROT_EXEC as u64);
    let exec = |arg: u8| rule(vec![cond(arg, Len::Dword, Op::MaskedEq(x), x)?]);
    deny(
        vec![
            (nr("mmap")?, vec![rule(vec![cond(2, Len::Dword, Op::MaskedEq(w | x), w | x)?])?]),
            (nr("mprotect")?, vec![exec(2)?]),
            (nr("pkey_mprotect")?, vec![exec(2)?]),
            (nr("shmat")?, vec![rule(vec![cond(2, Len::Dword, Op::MaskedEq(0o100000), 0o100000)?])?]), // SHM_EXEC
        ],
        errno(libc::EPERM),
        arch,
    )
}

/// sched_setscheduler(2) to a realtime policy fails.
pub(crate) fn restrict_realtime(arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let policies = [libc::SCHED_FIFO, libc::SCHED_RR, 6 /* SCHED_DEADLINE */];
    let rules =
        policies.iter().map(|&p| rule(vec![cond(1, Len::Dword, Op::Eq, p as u64)?])).collect::<anyhow::Result<_>>()?;
    deny(vec![(nr("sched_setscheduler")?, rules)], errno(libc::EPERM), arch)
}

/// personality(2) to anything but the default (and the query) fails.
pub(crate) fn lock_personality(arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let rules = vec![rule(vec![
        cond(0, Len::Dword, Op::Ne, 0)?,           // PER_LINUX
        cond(0, Len::Dword, Op::Ne, 0xffff_ffff)?, // the query
    ])?];
    deny(vec![(nr("personality")?, rules)], errno(libc::EPERM), arch)
}

/// No file gets a set-user-ID or set-group-ID bit: chmod(2) and friends, and creating one.
pub(crate) fn restrict_suid_sgid(arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let bits = [libc::S_ISUID as u64, libc::S_ISGID as u64];
    let mode_has = |arg: u8| -> anyhow::Result<Vec<SeccompRule>> {
        bits.iter().map(|&b| rule(vec![cond(arg, Len::Dword, Op::MaskedEq(b), b)?])).collect()
    };
    let creat = libc::O_CREAT as u64;
    let creating = |flags: u8, mode: u8| -> anyhow::Result<Vec<SeccompRule>> {
        bits.iter()
            .map(|&b| {
                rule(vec![
                    cond(flags, Len::Dword, Op::MaskedEq(creat), creat)?,
                    cond(mode, Len::Dword, Op::MaskedEq(b), b)?,
                ])
            })
            .collect()
    };
    deny(
        vec![
            (nr("chmod")?, mode_has(1)?),
            (nr("fchmod")?, mode_has(1)?),
            (nr("fchmodat")?, mode_has(2)?),
            (nr("mkdir")?, mode_has(1)?),
            (nr("mkdirat")?, mode_has(2)?),
            (nr("mknod")?, mode_has(1)?),
            (nr("mknodat")?, mode_has(2)?),
            (nr("creat")?, mode_has(1)?),
            (nr("open")?, creating(1, 2)?),
            (nr("openat")?, creating(2, 3)?),
        ],
        errno(libc::EPERM),
        arch,
    )
}

/// The allow list (or deny list, if the first line starts with `~`) the lines make, in order,
/// groups expanded by `systemd-analyze syscall-filter`; system calls this architecture does not
/// have are skipped, as systemd skips them.
pub(crate) fn syscall_filter(lines: &[String], errno_value: i32, arch: TargetArch) -> anyhow::Result<SeccompFilter> {
    let groups = syscall_groups()?;
    let allow_list = !lines[0].starts_with('~');
    let mut set: BTreeSet<String> = BTreeSet::new();
    if allow_list {
        set.extend(expand("@default", &groups)?);
    }
    for line in lines {
        let (removing, list) = match line.strip_prefix('~') {
            Some(rest) => (allow_list, rest),
            None => (!allow_list, line.as_str()),
        };
        for item in list.split_whitespace() {
            ensure!(!item.contains(':'), "SystemCallFilter: {item}: per-call errno is not supported here");
            for name in expand(item, &groups)? {
                if removing {
                    set.remove(&name);
                } else {
                    set.insert(name);
                }
            }
        }
    }
    let rules: BTreeMap<i64, Vec<SeccompRule>> =
        set.iter().filter_map(|name| Sysno::from_str(name).ok()).map(|s| (i64::from(s.id()), vec![])).collect();
    let (mismatch, matched) = if allow_list {
        (errno(errno_value), SeccompAction::Allow)
    } else {
        (SeccompAction::Allow, errno(errno_value))
    };
    Ok(SeccompFilter::new(rules, mismatch, matched, arch)?)
}

/// `@group` -> its entries (names and other groups), as this machine's systemd defines them.
fn syscall_groups() -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let out = Command::new("systemd-analyze")
        .args(["syscall-filter", "--no-pager"])
        .output()
        .context("running systemd-analyze syscall-filter (install systemd: cargo xtask setup)")?;
    ensure!(out.status.success(), "systemd-analyze syscall-filter: {}", String::from_utf8_lossy(&out.stderr));
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if line.starts_with('@') {
            current = Some(line.trim().to_string());
            groups.entry(line.trim().to_string()).or_default();
        } else if line.trim().is_empty() || !line.starts_with(' ') {
            current = None;
        } else if let Some(group) = &current
            && !line.trim_start().starts_with('#')
        {
            groups.entry(group.clone()).or_default().push(line.trim().to_string());
        }
    }
    ensure!(groups.contains_key("@system-service"), "systemd-analyze syscall-filter listed no @system-service");
    Ok(groups)
}

fn expand(item: &str, groups: &BTreeMap<String, Vec<String>>) -> anyhow::Result<Vec<String>> {
    if !item.starts_with('@') {
        return Ok(vec![item.to_string()]);
    }
    let entries = groups.get(item).with_context(|| format!("SystemCallFilter: no group {item} in systemd-analyze"))?;
    let mut out = Vec::new();
    for entry in entries {
        out.extend(expand(entry, groups)?);
    }
    Ok(out)
}
