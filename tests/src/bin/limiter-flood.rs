//! `limiter-flood`: send a bounded UDP flood out of one interface (run it inside the sender's
//! network namespace, e.g. `ip netns exec NS limiter-flood ...`). Prints one summary line.

use std::{net::IpAddr, process::ExitCode, time::Duration};

use anyhow::Context as _;
use clap::Parser;
use limiter_tests::flood::{
    DEFAULT_PAYLOAD, DEFAULT_SPORT, FrameSpec, Frames, Limits, PacketSocket, Prefix, Sources, iface_mac, parse_mac,
};

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
    /// Stop after this many packets.
    #[arg(long, default_value_t = 10_000_000)]
    count: u64,
    /// Stop after this many seconds (fractions allowed).
    #[arg(long, default_value_t = 5.0, value_parser = parse_seconds)]
    duration: f64,
    /// Pin the sending thread to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// UDP payload bytes.
    #[arg(long, default_value_t = DEFAULT_PAYLOAD)]
    payload: usize,
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
    let frames = Frames::build(&spec, &args.sources())?;
    let mut socket = PacketSocket::open(&args.iface)?;
    let limits = Limits { packets: args.count, duration: Duration::from_secs_f64(args.duration), cpu: args.cpu };
    let report = frames.send(&mut socket, &limits).context("flooding")?;
    println!("flood {report} sources={}", frames.count());
    Ok(())
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
