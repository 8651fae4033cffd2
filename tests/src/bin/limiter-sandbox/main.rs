//! `limiter-sandbox UNIT -- PROGRAM [ARGS...]`: execs PROGRAM under the restrictions the systemd
//! unit file UNIT puts on its service process, read from the file's `[Service]` section, for the
//! tests that run the daemon as the unit does (tests/packaging/unit_sandbox.rs) on machines where systemd is
//! not PID 1 (`systemd-run` needs it). Applied, in the order systemd applies them:
//!
//! - `LimitMEMLOCK=`, `LimitNOFILE=`, `UMask=`;
//! - `LoadCredential=`: each file copied into `$LIMITER_SANDBOX_CREDENTIALS/credentials`, which
//!   only the service's user may read, named `$CREDENTIALS_DIRECTORY` and `%d` in PROGRAM's
//!   arguments;
//! - `CapabilityBoundingSet=`; then `User=`, `Group=`, `DynamicUser=` (a uid of systemd's dynamic
//!   range, [`DYNAMIC_UID`]; no supplementary groups); then `AmbientCapabilities=` (the
//!   inheritable set too, as systemd does), `NoNewPrivileges=`;
//! - seccomp filters, each returning what systemd's returns: `RestrictAddressFamilies=`
//!   (EAFNOSUPPORT), `RestrictNamespaces=` (EPERM; clone3 ENOSYS, its flags are out of a
//!   filter's reach), `MemoryDenyWriteExecute=`, `RestrictRealtime=`, `LockPersonality=`,
//!   `RestrictSUIDSGID=`, `SystemCallArchitectures=native` (other ABIs are killed), and last
//!   `SystemCallFilter=` with `SystemCallErrorNumber=`, its groups expanded by
//!   `systemd-analyze syscall-filter` (systemd's own lists), `@default` added to an allow list
//!   and the lines applied in order (`~` removes).
//!
//! Directives about mounts, devices and the unit's lifecycle are listed in [`NOT_APPLIED`] and
//! left out; any other directive is refused (exit 2), so a hardening line added to the unit must
//! be taught here, or listed there, before the test passes again.

mod seccomp;

use std::{
    ffi::OsString,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    process::Command,
    str::FromStr as _,
};

use anyhow::{Context as _, bail, ensure};
use caps::{CapSet, Capability, CapsHashSet};
use nix::unistd::{Gid, Group, Uid, User};
use seccomp::{
    address_families, deny_write_execute, lock_personality, restrict_namespaces, restrict_realtime, restrict_suid_sgid,
    syscall_filter,
};
use seccompiler::{BpfProgram, SeccompFilter, TargetArch};

/// Directives this wrapper does not apply, and why that is acceptable for what the tests check
/// (the daemon's system calls, sockets and privileges).
const NOT_APPLIED: &[(&str, &str)] = &[
    ("Type", "lifecycle: the test checks readiness and exit codes itself"),
    ("NotifyAccess", "lifecycle"),
    ("EnvironmentFile", "the test passes the program's flags"),
    ("ExecStart", "the test runs the program with its own socket, config, pins, LAPI"),
    ("ExecReload", "the test runs `limiter-ctl reload` under this wrapper as ExecReload would be"),
    ("TimeoutStartSec", "lifecycle"),
    ("Restart", "lifecycle"),
    ("RestartSec", "lifecycle"),
    ("RestartPreventExitStatus", "lifecycle: the test checks exit codes"),
    ("ConfigurationDirectory", "a directory: the test's config is in its scratch directory"),
    ("RuntimeDirectory", "a directory: the test's socket is in its scratch directory"),
    ("RuntimeDirectoryPreserve", "a directory"),
    ("StateDirectory", "a directory: the test's state is in its scratch directory (--state-dir)"),
    ("ProtectSystem", "mount namespace: not applied"),
    ("ReadWritePaths", "mount namespace: not applied"),
    ("ProtectHome", "mount namespace: not applied"),
    ("PrivateTmp", "mount namespace: not applied"),
    ("PrivateDevices", "mount namespace and device cgroup: not applied"),
    ("ProtectKernelTunables", "mount namespace: not applied"),
    ("ProtectKernelModules", "mount namespace; its system calls are outside the allow list anyway"),
    ("ProtectKernelLogs", "mount namespace; syslog(2) is outside the allow list anyway"),
    ("ProtectControlGroups", "mount namespace: not applied"),
    ("ProtectClock", "device cgroup; @clock is outside the allow list anyway"),
    ("ProtectHostname", "UTS namespace; sethostname(2) is outside the allow list anyway"),
    ("ProtectProc", "mount namespace: not applied"),
    ("PrivateMounts", "mount namespace: not applied"),
    ("PrivateUsers", "user namespace (the service's own ids mapped as they are): not applied"),
    ("PrivateIPC", "IPC namespace: not applied (the services use no System V IPC)"),
    ("RemoveIPC", "cleanup at stop: not applied"),
    ("ProcSubset", "mount namespace: not applied"),
    ("IPAddressDeny", "cgroup BPF: not applied (the test's peers are on loopback, which it allows)"),
    ("IPAddressAllow", "cgroup BPF: not applied"),
    ("MemoryMax", "cgroup: not applied (the tests measure the peak themselves)"),
    ("TasksMax", "cgroup: not applied"),
];

/// The uid a `DynamicUser=` service runs as here: the first of systemd's dynamic range
/// (61184-65519), which no static user should hold.
const DYNAMIC_UID: u32 = 61_184;

fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let (unit, program) = match args.iter().position(|a| a == "--") {
        Some(1) if args.len() > 2 => (args[0].clone(), &args[2..]),
        _ => {
            eprintln!("usage: limiter-sandbox UNIT -- PROGRAM [ARGS...]");
            std::process::exit(2);
        }
    };
    let error = match Sandbox::from_unit(std::path::Path::new(&unit)) {
        // exec returns only on failure.
        Ok(sandbox) => sandbox.exec(program),
        Err(e) => {
            eprintln!("limiter-sandbox: {e:#}");
            std::process::exit(2);
        }
    };
    eprintln!("limiter-sandbox: {error:#}");
    std::process::exit(1);
}

/// What the unit restricts, resolved (capability and system call names to numbers).
#[derive(Default)]
struct Sandbox {
    memlock: Option<libc::rlim_t>,
    nofile: Option<libc::rlim_t>,
    umask: Option<libc::mode_t>,
    bounding: Option<CapsHashSet>,
    ambient: CapsHashSet,
    no_new_privs: bool,
    /// `User=`, `Group=` (names or numbers), `DynamicUser=`.
    user: Option<String>,
    group: Option<String>,
    dynamic_user: bool,
    /// `LoadCredential=`: each id and the file it is read from.
    credentials: Vec<(String, std::path::PathBuf)>,
    /// Filters installed before the system call filter (which may not allow seccomp(2) itself).
    filters: Vec<SeccompFilter>,
    syscall_filter: Option<SeccompFilter>,
}

impl Sandbox {
    fn from_unit(path: &std::path::Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let service = service_section(&text);
        let mut sandbox = Self::default();
        let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let mut syscall_lines = Vec::new();
        let mut errno = libc::EPERM;
        for (key, value) in &service {
            let yes = || parse_bool(key, value);
            match key.as_str() {
                "LimitMEMLOCK" => sandbox.memlock = Some(parse_limit(value)?),
                "LimitNOFILE" => sandbox.nofile = Some(parse_limit(value)?),
                "UMask" => {
                    sandbox.umask =
                        Some(libc::mode_t::from_str_radix(value, 8).with_context(|| format!("UMask={value}"))?)
                }
                "CapabilityBoundingSet" => {
                    let (invert, caps) = parse_caps(value)?;
                    let current =
                        sandbox.bounding.get_or_insert_with(|| if invert { caps::all() } else { CapsHashSet::new() });
                    if invert {
                        current.retain(|c| !caps.contains(c));
                    } else {
                        current.extend(caps);
                    }
                }
                "AmbientCapabilities" => {
                    let (invert, caps) = parse_caps(value)?;
                    ensure!(!invert, "AmbientCapabilities=~...: not supported here");
                    sandbox.ambient.extend(caps);
                }
                "NoNewPrivileges" => sandbox.no_new_privs = yes()?,
                "User" => sandbox.user = Some(value.clone()),
                "Group" => sandbox.group = Some(value.clone()),
                "DynamicUser" => sandbox.dynamic_user = yes()?,
                "LoadCredential" => {
                    let (id, file) =
                        value.split_once(':').with_context(|| format!("LoadCredential={value}: ID:PATH"))?;
                    sandbox.credentials.push((id.to_string(), file.into()));
                }
                "RestrictAddressFamilies" => sandbox.filters.push(address_families(value, arch)?),
                "RestrictNamespaces" if yes()? => sandbox.filters.extend(restrict_namespaces(arch)?),
                "MemoryDenyWriteExecute" if yes()? => sandbox.filters.push(deny_write_execute(arch)?),
                "RestrictRealtime" if yes()? => sandbox.filters.push(restrict_realtime(arch)?),
                "LockPersonality" if yes()? => sandbox.filters.push(lock_personality(arch)?),
                "RestrictSUIDSGID" if yes()? => sandbox.filters.push(restrict_suid_sgid(arch)?),
                "RestrictNamespaces"
                | "MemoryDenyWriteExecute"
                | "RestrictRealtime"
                | "LockPersonality"
                | "RestrictSUIDSGID" => {}
                // seccompiler's filters kill a process calling through another ABI.
                "SystemCallArchitectures" => ensure!(value == "native", "SystemCallArchitectures={value}: only native"),
                "SystemCallFilter" => syscall_lines.push(value.clone()),
                "SystemCallErrorNumber" => errno = parse_errno(value)?,
                other if NOT_APPLIED.iter().any(|(k, _)| *k == other) => {}
                other => bail!(
                    "{}: {other}= is not known to limiter-sandbox: apply it there, or list it in NOT_APPLIED with why",
                    path.display()
                ),
            }
        }
        if !syscall_lines.is_empty() {
            sandbox.syscall_filter = Some(syscall_filter(&syscall_lines, errno, arch)?);
        }
        Ok(sandbox)
    }

    /// Applies everything, then execs `program`; returns only if something failed.
    fn exec(self, program: &[OsString]) -> anyhow::Error {
        match self.apply() {
            Ok(credentials) => {
                let mut cmd = Command::new(&program[0]);
                match &credentials {
                    Some(dir) => {
                        let d = dir.as_os_str().to_string_lossy();
                        cmd.args(program[1..].iter().map(|a| a.to_string_lossy().replace("%d", &d)));
                        cmd.env("CREDENTIALS_DIRECTORY", dir);
                    }
                    None => {
                        cmd.args(&program[1..]);
                    }
                }
                let error = cmd.exec();
                anyhow::Error::new(error).context(format!("exec {}", program[0].to_string_lossy()))
            }
            Err(e) => e,
        }
    }

    /// The user and group the service runs as, if the unit names any.
    fn identity(&self) -> anyhow::Result<Option<(Uid, Gid)>> {
        let uid = if self.dynamic_user {
            Some(Uid::from_raw(DYNAMIC_UID))
        } else {
            match &self.user {
                None => None,
                Some(name) => Some(match name.parse() {
                    Ok(n) => Uid::from_raw(n),
                    Err(_) => User::from_name(name)?.with_context(|| format!("User={name}: no such user"))?.uid,
                }),
            }
        };
        let gid = match &self.group {
            Some(name) => Some(match name.parse() {
                Ok(n) => Gid::from_raw(n),
                Err(_) => Group::from_name(name)?.with_context(|| format!("Group={name}: no such group"))?.gid,
            }),
            // A dynamic user's group is its own; a static one's, its primary group.
            None if self.dynamic_user => Some(Gid::from_raw(DYNAMIC_UID)),
            None => match uid.map(User::from_uid).transpose()?.flatten() {
                Some(user) => Some(user.gid),
                None => None,
            },
        };
        Ok(match (uid, gid) {
            (None, None) => None,
            (uid, gid) => Some((uid.unwrap_or(Uid::from_raw(0)), gid.unwrap_or(Gid::from_raw(0)))),
        })
    }

    /// The credentials, copied where only the service's user reads them; their directory.
    fn load_credentials(&self, owner: Option<(Uid, Gid)>) -> anyhow::Result<Option<std::path::PathBuf>> {
        if self.credentials.is_empty() {
            return Ok(None);
        }
        let base = std::env::var_os("LIMITER_SANDBOX_CREDENTIALS")
            .context("LoadCredential=: set LIMITER_SANDBOX_CREDENTIALS to a directory for them")?;
        let dir = std::path::Path::new(&base).join("credentials");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        for (id, file) in &self.credentials {
            let to = dir.join(id);
            std::fs::copy(file, &to).with_context(|| format!("LoadCredential: {}", file.display()))?;
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o400))?;
            if let Some((uid, gid)) = owner {
                nix::unistd::chown(&to, Some(uid), Some(gid))?;
            }
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o500))?;
        if let Some((uid, gid)) = owner {
            nix::unistd::chown(&dir, Some(uid), Some(gid))?;
        }
        Ok(Some(dir))
    }

    /// Applies everything but the exec; the credentials' directory, if any.
    fn apply(self) -> anyhow::Result<Option<std::path::PathBuf>> {
        if let Some(limit) = self.memlock {
            let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            // SAFETY: a plain system call on a struct we own.
            if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &rlimit) } != 0 {
                let error = std::io::Error::last_os_error();
                // Raising it needs CAP_SYS_RESOURCE, which a container may not give; kernels since
                // 5.11 charge BPF maps to the memory cgroup instead, so the limit does not matter.
                ensure!(error.raw_os_error() == Some(libc::EPERM), "setrlimit(RLIMIT_MEMLOCK): {error}");
                eprintln!("limiter-sandbox: LimitMEMLOCK not applied (no CAP_SYS_RESOURCE here): {error}");
            }
        }
        if let Some(limit) = self.nofile {
            let rlimit = libc::rlimit { rlim_cur: limit, rlim_max: limit };
            // SAFETY: a plain system call on a struct we own.
            if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &rlimit) } != 0 {
                let error = std::io::Error::last_os_error();
                // Raising the hard limit needs CAP_SYS_RESOURCE, which a container may not give:
                // then the most the hard limit allows, as systemd would be refused too.
                ensure!(error.raw_os_error() == Some(libc::EPERM), "setrlimit(RLIMIT_NOFILE): {error}");
                let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                // SAFETY: as above.
                ensure!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) } == 0, "getrlimit(RLIMIT_NOFILE)");
                let capped = libc::rlimit { rlim_cur: limit.min(now.rlim_max), rlim_max: now.rlim_max };
                // SAFETY: as above.
                ensure!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &capped) } == 0, "setrlimit(RLIMIT_NOFILE)");
                eprintln!(
                    "limiter-sandbox: LimitNOFILE capped at the hard limit {} (no CAP_SYS_RESOURCE here)",
                    now.rlim_max
                );
            }
        }
        if let Some(mask) = self.umask {
            // SAFETY: umask cannot fail.
            unsafe { libc::umask(mask) };
        }
        let identity = self.identity()?;
        let credentials = self.load_credentials(identity)?;
        if let Some(bounding) = &self.bounding {
            for cap in caps::all().difference(bounding) {
                caps::drop(None, CapSet::Bounding, *cap)
                    .with_context(|| format!("dropping {cap} from the bounding set"))?;
            }
        }
        // Root's capabilities go with its uid (no SECBIT_KEEP_CAPS), so the bounding set first.
        if let Some((uid, gid)) = identity {
            nix::unistd::setgroups(&[]).context("setgroups")?;
            nix::unistd::setresgid(gid, gid, gid).with_context(|| format!("setresgid({gid})"))?;
            nix::unistd::setresuid(uid, uid, uid).with_context(|| format!("setresuid({uid})"))?;
        }
        // Ambient capabilities must be inheritable first; systemd makes the inheritable set the
        // ambient one.
        caps::set(None, CapSet::Inheritable, &self.ambient).context("setting inheritable")?;
        for cap in &self.ambient {
            caps::raise(None, CapSet::Ambient, *cap).with_context(|| format!("raising ambient {cap}"))?;
        }
        if self.no_new_privs {
            // SAFETY: a plain prctl.
            if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
                return Err(std::io::Error::last_os_error()).context("PR_SET_NO_NEW_PRIVS");
            }
        }
        for filter in self.filters.into_iter().chain(self.syscall_filter) {
            let program: BpfProgram = filter.try_into().context("compiling a seccomp filter")?;
            seccompiler::apply_filter(&program).context("installing a seccomp filter")?;
        }
        Ok(credentials)
    }
}

/// `[Service]`'s `key=value` lines in order (a key may repeat); comments and blank lines skipped.
fn service_section(text: &str) -> Vec<(String, String)> {
    let mut section = "";
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') {
            section = line;
        } else if section == "[Service]"
            && let Some((k, v)) = line.split_once('=')
        {
            out.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    out
}

fn parse_bool(key: &str, value: &str) -> anyhow::Result<bool> {
    match value {
        "yes" | "true" | "on" | "1" => Ok(true),
        "no" | "false" | "off" | "0" => Ok(false),
        _ => bail!("{key}={value}: not a boolean (namespace lists are not supported here)"),
    }
}

fn parse_limit(value: &str) -> anyhow::Result<libc::rlim_t> {
    match value {
        "infinity" => Ok(libc::RLIM_INFINITY),
        v => v.parse().with_context(|| format!("Limit*={v}: a number or infinity")),
    }
}

/// `[~]CAP_A CAP_B ...`
fn parse_caps(value: &str) -> anyhow::Result<(bool, CapsHashSet)> {
    let (invert, list) = match value.strip_prefix('~') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let caps = list
        .split_whitespace()
        .map(|name| Capability::from_str(name).map_err(|e| anyhow::anyhow!("capability {name}: {e}")))
        .collect::<anyhow::Result<_>>()?;
    Ok((invert, caps))
}

fn parse_errno(value: &str) -> anyhow::Result<i32> {
    Ok(match value {
        "EPERM" => libc::EPERM,
        "EACCES" => libc::EACCES,
        "ENOSYS" => libc::ENOSYS,
        "EAFNOSUPPORT" => libc::EAFNOSUPPORT,
        _ => bail!("SystemCallErrorNumber={value}: not supported here"),
    })
}
