//! The flood generator (used by the demo, `limiter-flood`, the daemon-cost tests and the peers
//! benchmark) sends what it says, from every source it says, with checksums the receiving kernel
//! accepts: a generator that broke them would have the stack, not the system under test, drop
//! the flood. It runs on the sender this machine offers ([`Sender::chosen`]: live frames where
//! the kernel allows them); `cargo xtask test` runs it again with the packet ring forced.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::{
    EbpfLoader,
    programs::{Xdp, XdpMode},
};
use limiter_ctl::objects;
use limiter_tests::{
    capture::Capture,
    cpu::pin_current_thread,
    flood::L4,
    generator::{Generator, Sender, SourceRange},
    netns::TestNet,
    require_root,
    snmp::Snmp,
};

const PER_SOURCE: u64 = 3;
const SOURCES: u32 = 500;

/// Checksum errors of every protocol the generator can send, in the receiver's namespace.
fn checksum_errors(s: &Snmp) -> anyhow::Result<u64> {
    Ok(s.get("Ip:", "InHdrErrors")?
        + s.get("Udp:", "InCsumErrors")?
        + s.get("Tcp:", "InCsumErrors")?
        + s.get("Icmp:", "InCsumErrors")?
        + s.get6("Udp6InCsumErrors")?
        + s.get6("Icmp6InCsumErrors")?)
}

/// Datagrams of `l4` the receiving stack accepted as well-formed.
fn received(s: &Snmp, l4: L4, v6: bool) -> anyhow::Result<u64> {
    Ok(match (l4, v6) {
        (L4::Udp, false) => s.get("Udp:", "NoPorts")?,
        (L4::Udp, true) => s.get6("Udp6NoPorts")?,
        (L4::TcpSyn, _) => s.get("Tcp:", "InSegs")?,
        (L4::IcmpEcho, false) => s.get("Icmp:", "InEchos")?,
        (L4::IcmpEcho, true) => s.get6("Icmp6InEchos")?,
    })
}

fn check(l4: L4, first: IpAddr) -> anyhow::Result<()> {
    let net = TestNet::new()?;
    // A veth end only takes XDP frames while it runs an XDP program: the bare XDP_PASS one.
    let mut ebpf = EbpfLoader::new().load(objects::BENCH)?;
    let pass: &mut Xdp = ebpf.program_mut("bench_pass").expect("bench_pass").try_into()?;
    pass.load()?;
    let iface = net.receiver.iface.clone();
    net.receiver.run(|| pass.attach(&iface, XdpMode::Driver))??;

    let spec = net.frames_to(first.is_ipv6(), 9);
    let sources = SourceRange { first, count: SOURCES };
    let generator = Generator::new(&spec, l4, sources)?;
    let before = Snmp::read(&net.receiver)?;
    let capture = Capture::start(&net.receiver)?;
    let sender = net.sender.iface.clone();
    let frames = PER_SOURCE * u64::from(SOURCES);
    let report = net.sender.run(move || -> anyhow::Result<_> {
        pin_current_thread(1)?;
        generator.send(&sender, frames, Duration::from_secs(10))
    })??;
    let captured = capture.finish()?;
    let after = Snmp::read(&net.receiver)?;

    assert_eq!(
        report.sent, frames,
        "{l4:?} from {first}: the generator sent {} of {frames} frames in the 10 s it had ({report}): the machine \
         was too slow",
        report.sent
    );
    let mut per_source: BTreeMap<IpAddr, u64> = BTreeMap::new();
    for s in &captured.seen {
        assert_eq!(s.flow.l4, l4, "{l4:?}: a frame of another protocol: {:?}", s.flow);
        *per_source.entry(s.flow.src).or_default() += 1;
    }
    let expected: BTreeMap<IpAddr, u64> = (0..SOURCES).map(|i| (sources.nth(i), PER_SOURCE)).collect();
    assert_eq!(captured.drops, 0, "the capture lost frames");
    assert_eq!(per_source, expected, "{l4:?} from {first}: sources or counts differ");
    assert_eq!(
        checksum_errors(&after)? - checksum_errors(&before)?,
        0,
        "{l4:?} from {first}: the stack saw bad checksums"
    );
    let v6 = first.is_ipv6();
    let accepted = received(&after, l4, v6)? - received(&before, l4, v6)?;
    assert_eq!(accepted, frames, "{l4:?} from {first}: the stack accepted {accepted} of {frames}");
    Ok(())
}

#[test]
fn the_generator_sends_valid_frames_from_every_source() {
    require_root!();
    eprintln!("sender: {}", Sender::chosen().unwrap_or_else(|e| panic!("{e:#}")));
    let v4 = IpAddr::V4(Ipv4Addr::new(198, 19, 3, 1));
    let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2));
    for (l4, first) in
        [(L4::Udp, v4), (L4::TcpSyn, v4), (L4::IcmpEcho, v4), (L4::Udp, v6), (L4::TcpSyn, v6), (L4::IcmpEcho, v6)]
    {
        check(l4, first).unwrap_or_else(|e| panic!("{l4:?} from {first}: {e:#}"));
    }
}
