//! Debian's fail2ban, run by a test without systemd: `fail2ban-server -f -x` with a config
//! directory of the test's own (a temp dir), its database in memory, one jail over a log file
//! the test writes, banning through the action the package ships
//! (packaging/fail2ban/action.d/limiter.conf) against the test's daemon. Stopped by its pid,
//! and its directory removed, on drop.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::service::{Service, run_ok};

/// The server and the client (Debian's fail2ban; `cargo xtask setup` installs it).
pub const SERVER: &str = "fail2ban-server";
pub const CLIENT: &str = "fail2ban-client";
/// The jail's name, and its filter's.
pub const JAIL: &str = "limiter-test";

/// The action the package installs at /etc/fail2ban/action.d/limiter.conf.
pub fn shipped_action() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/fail2ban/action.d/limiter.conf")
}

/// What the jail does.
pub struct Jail {
    /// The limiter-ctl the action runs, and the daemon's socket it talks to.
    pub limiter_ctl: PathBuf,
    pub socket: PathBuf,
    /// Failures (lines `FAIL from ADDR`) within `findtime` that get a source banned.
    pub maxretry: u32,
    /// The ban's time in seconds; -1: permanent.
    pub bantime: i64,
}

pub struct Fail2ban {
    server: Service,
    dir: tempfile::TempDir,
}

impl Fail2ban {
    /// Writes the config (fail2ban.conf, the jail, its filter, the shipped action) and starts
    /// the server; returns once it answers `ping`.
    pub fn start(jail: &Jail) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("lmt-f2b-").tempdir().context("creating fail2ban's directory")?;
        let d = dir.path();
        let cfg = d.join("cfg");
        for sub in ["action.d", "filter.d", "jail.d"] {
            std::fs::create_dir_all(cfg.join(sub)).with_context(|| format!("creating {}", cfg.join(sub).display()))?;
        }
        write(
            &cfg.join("fail2ban.conf"),
            &format!(
                "[Definition]\nloglevel = INFO\nlogtarget = {}\ndbfile = :memory:\n",
                d.join("fail2ban.log").display()
            ),
        )?;
        // The application's log lines carry no date: fail2ban then takes the time it reads them.
        write(
            &cfg.join("filter.d").join(format!("{JAIL}.conf")),
            "[Definition]\nfailregex = ^FAIL from <HOST>$\ndatepattern = {NONE}\n",
        )?;
        let action = shipped_action();
        std::fs::copy(&action, cfg.join("action.d/limiter.conf"))
            .with_context(|| format!("copying {}", action.display()))?;
        let app_log = d.join("app.log");
        write(&app_log, "")?;
        // polling: fail2ban's own file watching, whatever Python modules are installed.
        write(
            &cfg.join("jail.conf"),
            &format!(
                "[{JAIL}]\nenabled = true\nfilter = {JAIL}\nlogpath = {}\nbackend = polling\nmaxretry = {}\nfindtime = \
                 600\nbantime = {}\naction = limiter[limiter_ctl=\"{}\", socket=\"{}\"]\n",
                app_log.display(),
                jail.maxretry,
                jail.bantime,
                jail.limiter_ctl.display(),
                jail.socket.display()
            ),
        )?;
        let mut cmd = Command::new(SERVER);
        cmd.args(["-f", "-x", "-c"]).arg(&cfg).arg("-s").arg(d.join("f2b.sock")).arg("-p").arg(d.join("f2b.pid"));
        let server =
            Service::spawn(SERVER, &mut cmd).context("is fail2ban installed? (`cargo xtask setup` installs it)")?;
        let mut f2b = Self { server, dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if f2b.client(&["ping"]).is_ok_and(|out| out.contains("pong"))
                && f2b.log().contains(&format!("Jail '{JAIL}' started"))
            {
                // The polling backend tells a change by the file's stat, to the second: lines
                // written in the second the jail took the file could go unseen.
                thread::sleep(Duration::from_millis(1100));
                return Ok(f2b);
            }
            if let Some(status) = f2b.server.exited() {
                bail!("{SERVER} exited ({status}) at start:\n{}\n{}", f2b.server.output(), f2b.log());
            }
            if Instant::now() >= deadline {
                bail!("{SERVER} did not answer ping within 20 s:\n{}\n{}", f2b.server.output(), f2b.log());
            }
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// `fail2ban-client -s SOCKET ARGS...`: its stdout, or an error with everything it said.
    pub fn client(&self, args: &[&str]) -> anyhow::Result<String> {
        run_ok(Command::new(CLIENT).arg("-s").arg(self.dir.path().join("f2b.sock")).args(args))
    }

    /// Appends `count` failure lines from `source` to the log the jail reads.
    pub fn fail(&self, source: &str, count: u32) -> anyhow::Result<()> {
        let path = self.dir.path().join("app.log");
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let lines: String = (0..count).map(|_| format!("FAIL from {source}\n")).collect();
        file.write_all(lines.as_bytes()).with_context(|| format!("writing {}", path.display()))
    }

    /// fail2ban's own log (bans, unbans, the action's errors).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("fail2ban.log")).unwrap_or_default()
    }

    /// Waits up to `timeout` for fail2ban's log to hold `what` (`Ban 198.18.0.9`); when it was seen.
    pub fn wait_log(&self, what: &str, timeout: Duration) -> anyhow::Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(what) {
                return Ok(Instant::now());
            }
            if Instant::now() >= deadline {
                bail!("fail2ban's log did not say {what:?} within {timeout:?}:\n{}", self.log());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the server (SIGTERM, which unbans what it banned, as on any stop).
    pub fn stop(&mut self) {
        self.server.stop();
    }
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
