//! A long-running process a test starts (fail2ban's server, CrowdSec's local API, the CrowdSec
//! bouncer): its output lines collected as they come, and stopped by its own pid on drop
//! (SIGTERM, then SIGKILL after a grace), whatever the test did.

use std::{
    io::{BufRead as _, BufReader, Read},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::netns::describe;

/// How long a service gets to stop on SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(5);

pub struct Service {
    /// What it is, for messages (`fail2ban-server`, `crowdsec LAPI`...).
    pub name: String,
    child: Option<Child>,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Service {
    /// Starts `cmd` with stdin closed and its stdout and stderr collected (stderr lines start
    /// with `! `).
    pub fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let what = describe(cmd);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name}: `{what}`"))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        collect(child.stdout.take(), "", lines.clone());
        collect(child.stderr.take(), "! ", lines.clone());
        Ok(Self { name: name.to_owned(), child: Some(child), lines })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Everything it said so far, one line each.
    pub fn output(&self) -> String {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines.iter().map(|(_, l)| format!("{l}\n")).collect()
    }

    /// The lines it said after `since`.
    pub fn lines_since(&self, since: Instant) -> Vec<String> {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines.iter().filter(|(at, _)| *at >= since).map(|(_, l)| l.clone()).collect()
    }

    /// Waits up to `timeout` for a line (said after `since`) that `want` accepts; the time it
    /// was read, and the line.
    pub fn wait_line(
        &mut self,
        since: Instant,
        want: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<(Instant, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
                if let Some((at, l)) = lines.iter().find(|(at, l)| *at >= since && want(l)) {
                    return Ok((*at, l.clone()));
                }
            }
            if let Some(status) = self.exited() {
                bail!("{} exited ({status}) before saying what was awaited:\n{}", self.name, self.output());
            }
            if Instant::now() >= deadline {
                bail!("{} did not say what was awaited within {timeout:?}:\n{}", self.name, self.output());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM, then SIGKILL after [`STOP_GRACE`]; its exit status (None if it had been stopped).
    pub fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            thread::sleep(Duration::from_millis(20));
        }
        eprintln!("{} (pid {pid}) did not stop on SIGTERM within {STOP_GRACE:?}: killed", self.name);
        let _ = child.kill();
        child.wait().ok()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop();
    }
}

fn collect(stream: Option<impl Read + Send + 'static>, tag: &'static str, lines: Arc<Mutex<Vec<(Instant, String)>>>) {
    let Some(stream) = stream else { return };
    thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            lines.lock().unwrap_or_else(|e| e.into_inner()).push((Instant::now(), format!("{tag}{line}")));
        }
    });
}

/// Runs `cmd` to its end; its stdout, or an error with everything it said.
pub fn run_ok(cmd: &mut Command) -> anyhow::Result<String> {
    let what = describe(cmd);
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running `{what}`"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!("`{what}` failed ({}):\n{stdout}{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(stdout)
}
