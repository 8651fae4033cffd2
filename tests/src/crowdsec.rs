//! Debian's CrowdSec local API (LAPI), run by a test: the binaries `cargo xtask setup` extracts
//! from the package (not installed: its postinst needs CrowdSec's central API), with a config
//! of the test's own in a temp dir: no central API (`online_client` absent), sqlite in the temp
//! dir, listening on a free port of 127.0.0.1, the agent off (`crowdsec -no-cs`). `cscli`
//! adds the machine, the bouncer and the decisions. Stopped by its pid, and its directory
//! removed, on drop.
//!
//! And [`StandIn`], a stand-in for the LAPI answering what the test scripts.

use std::{
    io::{BufRead as _, BufReader, BufWriter, Read as _, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::service::{Service, run_ok};

/// Where `cargo xtask setup` extracts the package (xtask/src/setup.rs, `CROWDSEC_ROOT`).
pub const ROOT: &str = "/var/cache/limiter-tests/crowdsec/root";

pub fn binary(name: &str) -> PathBuf {
    Path::new(ROOT).join("usr/bin").join(name)
}

pub struct Lapi {
    server: Option<Service>,
    dir: tempfile::TempDir,
    addr: SocketAddr,
}

impl Lapi {
    /// Writes the config, registers a machine (for cscli) and starts the LAPI; returns once it
    /// takes connections.
    pub fn start() -> anyhow::Result<Self> {
        for b in ["crowdsec", "cscli"] {
            if !binary(b).is_file() {
                bail!("{} is missing: `cargo xtask setup` extracts Debian's crowdsec there", binary(b).display());
            }
        }
        let dir =
            tempfile::Builder::new().prefix("lmt-crowdsec-").tempdir().context("creating crowdsec's directory")?;
        let d = dir.path();
        for sub in ["cfg", "data", "hub"] {
            std::fs::create_dir_all(d.join(sub)).with_context(|| format!("creating {}", d.join(sub).display()))?;
        }
        // A free port: taken, then let go for the LAPI to bind (a small race, on loopback only).
        let addr = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .context("finding a free port for the LAPI")?;
        let cfg = d.join("cfg");
        std::fs::write(cfg.join("simulation.yaml"), "simulation: false\n").context("writing simulation.yaml")?;
        std::fs::write(cfg.join("profiles.yaml"), PROFILES).context("writing profiles.yaml")?;
        let config = format!(
            "common:\n  daemonize: false\n  log_media: stdout\n  log_level: info\n  working_dir: .\nconfig_paths:\n  \
             config_dir: {d}/cfg/\n  data_dir: {d}/data/\n  simulation_path: {d}/cfg/simulation.yaml\n  hub_dir: \
             {d}/hub/\n  index_path: {d}/hub/.index.json\n  notification_dir: {d}/cfg/notifications/\n  plugin_dir: \
             {ROOT}/usr/lib/crowdsec/plugins/\ndb_config:\n  log_level: info\n  type: sqlite\n  db_path: \
             {d}/data/crowdsec.db\n  use_wal: false\napi:\n  client:\n    credentials_path: \
             {d}/cfg/local_api_credentials.yaml\n  server:\n    log_level: info\n    listen_uri: {addr}\n    \
             profiles_path: {d}/cfg/profiles.yaml\n    trusted_ips:\n      - 127.0.0.1\nprometheus:\n  enabled: \
             false\n",
            d = d.display()
        );
        std::fs::write(cfg.join("config.yaml"), config).context("writing config.yaml")?;
        let mut lapi = Self { server: None, dir, addr };
        let creds = lapi.dir.path().join("cfg/local_api_credentials.yaml");
        let creds = creds.to_str().context("a temp dir's path is UTF-8")?.to_owned();
        lapi.cscli(&["machines", "add", "--auto", "--force", "-f", &creds])?;
        lapi.resume()?;
        Ok(lapi)
    }

    /// The config file.
    pub fn config(&self) -> PathBuf {
        self.dir.path().join("cfg/config.yaml")
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `cscli -c CONFIG ARGS...`: its stdout, or an error with everything it said.
    pub fn cscli(&self, args: &[&str]) -> anyhow::Result<String> {
        run_ok(Command::new(binary("cscli")).arg("-c").arg(self.config()).args(args))
    }

    /// Registers a bouncer and returns its API key (`cscli bouncers add NAME -o raw`).
    pub fn add_bouncer(&self, name: &str) -> anyhow::Result<String> {
        let out = self.cscli(&["bouncers", "add", name, "-o", "raw"])?;
        let key = out.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or_default().to_owned();
        if key.is_empty() || key.contains(' ') {
            bail!("`cscli bouncers add {name} -o raw` printed no key: {out:?}");
        }
        Ok(key)
    }

    /// Stops the LAPI (SIGTERM, by its pid); [`Lapi::resume`] starts it again on the same
    /// config, database and port.
    pub fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            server.stop();
        }
    }

    /// Starts the LAPI; returns once it takes connections on its port.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        let mut cmd = Command::new(binary("crowdsec"));
        cmd.arg("-c").arg(self.config()).arg("-no-cs").current_dir(self.dir.path());
        let mut server = Service::spawn("crowdsec LAPI", &mut cmd)?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&self.addr, Duration::from_millis(200)).is_err() {
            if let Some(status) = server.exited() {
                bail!("the crowdsec LAPI exited ({status}) at start:\n{}", server.output());
            }
            if Instant::now() >= deadline {
                bail!("the crowdsec LAPI took no connection on {} within 20 s:\n{}", self.addr, server.output());
            }
            thread::sleep(Duration::from_millis(50));
        }
        self.server = Some(server);
        Ok(())
    }

    /// What the LAPI said (its log goes to stdout).
    pub fn output(&self) -> String {
        self.server.as_ref().map(Service::output).unwrap_or_default()
    }
}

/// The package's profile: alerts on an address become a ban of 4 h (decisions `cscli decisions
/// add` makes carry their own duration and skip it).
const PROFILES: &str = "name: default_ip_remediation\nfilters:\n - Alert.Remediation == true && Alert.GetScope() == \
                        \"Ip\"\ndecisions:\n - type: ban\n   duration: 4h\non_success: break\n";

/// A stand-in for the LAPI: a plain HTTP server on loopback answering the decision stream with
/// what the test scripts, for what a real LAPI never sends (garbage, unreadable decisions,
/// answers of hundreds of MiB). Two scripts: one for the full set (`startup=true`), one for the
/// changes; each poll takes the next answer of its script, the last one repeating. Each
/// connection is answered and closed; the server stops on drop.
pub struct StandIn {
    addr: SocketAddr,
    shared: Arc<Mutex<Scripts>>,
    stop: Arc<AtomicBool>,
    serving: Option<thread::JoinHandle<()>>,
}

/// An answer of the stand-in.
#[derive(Clone, Debug)]
pub enum Answer {
    /// 200 with this body.
    Body(Vec<u8>),
    /// This status, with no body.
    Status(u16),
    /// Bytes as they are, HTTP or not.
    Raw(Vec<u8>),
    /// 200 with `head`, then `count` times `item` separated by commas, then `tail`, written as
    /// it goes (never held whole: a body of hundreds of MiB).
    Repeated { head: Vec<u8>, item: Vec<u8>, count: usize, tail: Vec<u8> },
    /// 200 with `head`, then `count` distinct IPv4 bans (`10.x.y.z`, 1 h) made as it goes,
    /// then `tail`.
    ManyBans { head: Vec<u8>, count: usize, tail: Vec<u8> },
}

impl Answer {
    /// 200 with a stream of these `new` decisions and these `deleted` ones (JSON objects).
    pub fn stream(new: &[String], deleted: &[String]) -> Self {
        let list =
            |items: &[String]| if items.is_empty() { "null".to_string() } else { format!("[{}]", items.join(",")) };
        Answer::Body(format!(r#"{{"deleted":{},"new":{}}}"#, list(deleted), list(new)).into_bytes())
    }

    /// Writes it as the HTTP answer.
    fn write(&self, out: &mut impl Write) -> std::io::Result<()> {
        let head = |len: usize| format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n");
        match self {
            Answer::Body(body) => {
                out.write_all(head(body.len()).as_bytes())?;
                out.write_all(body)
            }
            Answer::Status(status) => {
                write!(out, "HTTP/1.1 {status} Stand-in\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            }
            Answer::Raw(bytes) => out.write_all(bytes),
            Answer::Repeated { head: h, item, count, tail } => {
                let len = h.len() + item.len() * count + count.saturating_sub(1) + tail.len();
                out.write_all(head(len).as_bytes())?;
                out.write_all(h)?;
                let mut chunk = Vec::with_capacity(1 << 20);
                for i in 0..*count {
                    if i > 0 {
                        chunk.push(b',');
                    }
                    chunk.extend_from_slice(item);
                    if chunk.len() >= 1 << 20 {
                        out.write_all(&chunk)?;
                        chunk.clear();
                    }
                }
                out.write_all(&chunk)?;
                out.write_all(tail)
            }
            Answer::ManyBans { head: h, count, tail } => {
                let ban = |i: usize| {
                    format!(
                        r#"{{"duration":"1h","id":{i},"scope":"Ip","type":"ban","value":"10.{}.{}.{}"}}"#,
                        (i >> 16) & 255,
                        (i >> 8) & 255,
                        i & 255
                    )
                };
                let len =
                    h.len() + (0..*count).map(|i| ban(i).len()).sum::<usize>() + count.saturating_sub(1) + tail.len();
                out.write_all(head(len).as_bytes())?;
                out.write_all(h)?;
                let mut chunk = String::with_capacity(1 << 20);
                for i in 0..*count {
                    if i > 0 {
                        chunk.push(',');
                    }
                    chunk.push_str(&ban(i));
                    if chunk.len() >= 1 << 20 {
                        out.write_all(chunk.as_bytes())?;
                        chunk.clear();
                    }
                }
                out.write_all(chunk.as_bytes())?;
                out.write_all(tail)
            }
        }
    }
}

/// The bouncer, as an operator runs it (`limiter-ctl crowdsec`, the release binary, the default
/// poll interval of 1 s), against the daemon at `socket`.
pub fn start_bouncer(socket: &Path, lapi_url: &str, key_file: &Path) -> anyhow::Result<Service> {
    let mut cmd = Command::new(crate::daemon::limiter_ctl_binary()?);
    cmd.arg("--socket").arg(socket).args(["crowdsec", "--lapi", lapi_url, "--key-file"]).arg(key_file);
    Service::spawn("limiter-ctl crowdsec", &mut cmd)
}

/// A key file for a [`StandIn`] (which takes any), in a directory of its own.
pub fn stand_in_key() -> anyhow::Result<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().context("a temp dir for the key")?;
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, "0123456789abcdef\n").context("writing the key")?;
    Ok((dir, key_file))
}

/// A decision as the LAPI writes it, with its `duration` as given (a Go duration in quotes, or
/// any other JSON).
pub fn decision(id: u64, scope: &str, value: &str, duration: &str) -> String {
    format!(
        r#"{{"duration":{duration},"id":{id},"origin":"crowdsec","scenario":"test","scope":"{scope}","type":"ban","value":"{value}"}}"#
    )
}

#[derive(Default)]
struct Scripts {
    full: Vec<Answer>,
    changes: Vec<Answer>,
    /// Each poll: whether it asked for the full set.
    polls: Vec<bool>,
}

/// The next answer of a script: its first, which goes unless it is the last.
fn next(script: &mut Vec<Answer>) -> Option<Answer> {
    if script.len() > 1 { Some(script.remove(0)) } else { script.first().cloned() }
}

impl StandIn {
    /// Serving on a free port of 127.0.0.1, with `full` and `changes` as its scripts.
    pub fn start(full: Vec<Answer>, changes: Vec<Answer>) -> anyhow::Result<Self> {
        let server = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding the stand-in LAPI")?;
        let addr = server.local_addr().context("the stand-in's address")?;
        server.set_nonblocking(true).context("the stand-in's listener")?;
        let shared = Arc::new(Mutex::new(Scripts { full, changes, polls: Vec::new() }));
        let stop = Arc::new(AtomicBool::new(false));
        let (scripts, done) = (shared.clone(), stop.clone());
        let serving = thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                let Ok((conn, _)) = server.accept() else {
                    thread::sleep(Duration::from_millis(10));
                    continue;
                };
                serve(conn, &scripts);
            }
        });
        Ok(Self { addr, shared, stop, serving: Some(serving) })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// New scripts, from the next poll on.
    pub fn play(&self, full: Vec<Answer>, changes: Vec<Answer>) {
        let mut scripts = self.shared.lock().unwrap_or_else(|e| e.into_inner());
        scripts.full = full;
        scripts.changes = changes;
    }

    /// Each poll so far: whether it asked for the full set.
    pub fn polls(&self) -> Vec<bool> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner()).polls.clone()
    }
}

/// One connection: the request read, the next answer of its script written, the connection
/// closed. A client that hangs up early (the bouncer refusing an answer half read) is no error.
fn serve(conn: TcpStream, scripts: &Mutex<Scripts>) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(30)));
    let mut request = String::new();
    let mut reader = BufReader::new(&conn);
    while reader.read_line(&mut request).is_ok_and(|n| n > 2) {}
    let full = request.lines().next().is_some_and(|l| l.contains("startup=true"));
    let answer = {
        let mut scripts = scripts.lock().unwrap_or_else(|e| e.into_inner());
        scripts.polls.push(full);
        next(if full { &mut scripts.full } else { &mut scripts.changes })
    };
    if let Some(answer) = answer {
        let _ = answer.write(&mut BufWriter::with_capacity(1 << 20, &conn));
    }
    let _ = conn.shutdown(std::net::Shutdown::Write);
    // What the client still sends, until it closes: its end closes first, so no reset loses
    // the answer's tail.
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = std::io::copy(&mut (&conn).take(1 << 20), &mut std::io::sink());
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(serving) = self.serving.take() {
            let _ = serving.join();
        }
    }
}
