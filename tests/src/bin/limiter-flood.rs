//! `limiter-flood`: send a bounded UDP flood out of one interface (run it inside the sender's
//! network namespace, e.g. `ip netns exec NS limiter-flood ...`). Prints one summary line.
//!
//! Senders (`--sender`): `auto` (the default) is the flood generator's choice
//! ([`limiter_tests::generator`]): live frames (BPF_PROG_TEST_RUN; about ten times an AF_PACKET
//! socket here; on a veth pair the receiving end needs an XDP program, as the limiter is) where
//! the kernel allows them, else an AF_PACKET TX ring. `live` and `ring` ask for one of those;
//! `socket` sends each frame with a system call of its own and works anywhere. The summary line
//! names the sender, and a line on stderr why it was chosen.

use std::{net::IpAddr, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use limiter_tests::{
    flood::{
        DEFAULT_PAYLOAD, DEFAULT_SPORT, FrameSpec, Frames, L4, Limits, PacketSocket, Prefix, Sources, cap, iface_mac,
        parse_mac,
    },
    generator::{Choice, Generator, SENDER_ENV, SourceRange},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum SenderArg {
    /// Live frames where the kernel allows them, else the packet ring.
    Auto,
    /// BPF_PROG_TEST_RUN with live frames (IPv6 sources then vary in their /64: bytes 4 to 8;
    /// so with `ring`).
    Live,
    /// An AF_PACKET socket with a TX ring, past the qdisc.
    Ring,
    /// An AF_PACKET socket, one system call per frame.
    Socket,
}

#[derive(Debug, Parser)]
#[command(name = "limiter-flood", about = "Bounded UDP flood from one or many (spoofed) sources")]
struct Args {
    /// Interface to send on.
    #[arg(long)]
    iface: String,
    /// Destination MAC (the receiver's interface).
    #[arg(long, value_parser = parse_mac)]
    dst_mac: [u8; 6],
    /// Source MAC [default: the interface's own].
    #[arg(long, value_parser = parse_mac)]
    src_mac: Option<[u8; 6]>,
    /// Destination address.
    #[arg(long)]
    dst: IpAddr,
    #[arg(long, default_value_t = 9)]
    dport: u16,
    #[arg(long, default_value_t = DEFAULT_SPORT)]
    sport: u16,
    /// One source address.
    #[arg(long, conflicts_with_all = ["spoof", "sweep"], required_unless_present_any = ["spoof", "sweep"])]
    src: Option<IpAddr>,
    /// Spoof sources from this prefix (with --sources), round robin.
    #[arg(long, requires = "sources", conflicts_with = "sweep")]
    spoof: Option<Prefix>,
    /// How many spoofed sources.
    #[arg(long, requires = "spoof")]
    sources: Option<u32>,
    /// Send from every address of this prefix in turn.
    #[arg(long)]
    sweep: Option<Prefix>,
    /// Stop after this many packets [default: none the duration can reach, a safety cap of the
    /// duration at 100 Mpps]: the duration is what stops a flood.
    #[arg(long)]
    count: Option<u64>,
    /// Stop after this many seconds (fractions allowed).
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    duration: f64,
    /// Pin the sending thread to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// UDP payload bytes.
    #[arg(long, default_value_t = DEFAULT_PAYLOAD)]
    payload: usize,
    /// How frames are sent.
    #[arg(long, value_enum, env = SENDER_ENV, default_value_t = SenderArg::Auto)]
    sender: SenderArg,
}

fn parse_seconds(s: &str) -> Result<f64, String> {
    match s.trim_end_matches('s').parse::<f64>() {
        Ok(v) if v > 0.0 && v <= 3600.0 => Ok(v),
        _ => Err(format!("invalid duration '{s}': expected seconds from 0 to 3600, e.g. 5 or 0.5")),
    }
}

impl Args {
    fn sources(&self) -> Sources {
        match (self.src, self.spoof, self.sweep) {
            (Some(src), ..) => Sources::One(src),
            (_, Some(prefix), _) => Sources::Spoofed { prefix, count: self.sources.unwrap_or(1) },
            (_, _, Some(prefix)) => Sources::Sweep(prefix),
            // clap requires one of the three.
            _ => unreachable!("clap requires --src, --spoof or --sweep"),
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let src_mac = match args.src_mac {
        Some(mac) => mac,
        None => iface_mac(&args.iface)?,
    };
    let spec = FrameSpec {
        src_mac,
        dst_mac: args.dst_mac,
        dst: args.dst,
        sport: args.sport,
        dport: args.dport,
        payload: args.payload,
    };
    let duration = Duration::from_secs_f64(args.duration);
    let count = args.count.unwrap_or_else(|| cap(duration));
    let asked = match args.sender {
        SenderArg::Socket => {
            let frames = Frames::build(&spec, &args.sources())?;
            let mut socket = PacketSocket::open(&args.iface)?;
            let limits = Limits { packets: count, duration, cpu: args.cpu };
            let report = frames.send(&mut socket, &limits).context("flooding")?;
            println!("flood {report} sources={}", frames.count());
            return Ok(());
        }
        SenderArg::Auto => "auto",
        SenderArg::Live => "live",
        SenderArg::Ring => "ring",
    };
    let choice = Choice::asked(asked)?;
    eprintln!("flood: sender {choice}");
    let sources = source_range(&args.sources())?;
    let generator = Generator::with(choice, &spec, L4::Udp, sources)?;
    if let Some(cpu) = args.cpu {
        limiter_tests::cpu::pin_current_thread(cpu).with_context(|| format!("pinning to CPU {cpu}"))?;
    }
    let report = generator.send(&args.iface, count, duration)?;
    println!("flood {report} sources={}", sources.count);
    Ok(())
}

/// The generator's sources: consecutive 4-byte values from the first address.
fn source_range(sources: &Sources) -> anyhow::Result<SourceRange> {
    Ok(match sources {
        Sources::One(src) => SourceRange::one(*src),
        Sources::Spoofed { prefix, count } => {
            SourceRange { first: prefix.nth(1).context("a prefix without hosts")?, count: *count }
        }
        Sources::Sweep(prefix) => SourceRange {
            first: prefix.nth(0).context("empty prefix")?,
            count: u32::try_from(prefix.size()).context("a sweep of more than 2^32 addresses")?,
        },
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
