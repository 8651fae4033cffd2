//! A TCP bulk transfer between the two ends of a [`TestNet`], bounded by bytes and time, its
//! sender pinned to [`flood_cpu`]: the traffic of an established connection, for tests that
//! measure what the limiter does to it.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use crate::{
    cpu::{flood_cpu, pin_current_thread},
    netns::TestNet,
};

/// One connection from the sender to `port` on the receiver (`v6`: over IPv6), sending at most
/// `bytes` for at most `limit`: the bytes the receiver read, and the time from before the
/// connection to the reader's end of file. Panics on any socket error (what failed is said).
pub fn bulk(net: &TestNet, v6: bool, port: u16, bytes: u64, limit: Duration) -> (u64, Duration) {
    let dst = SocketAddr::new(net.receiver.addr(v6), port);
    let listener = net.receiver.run(move || TcpListener::bind(dst)).expect("namespace").expect("listening");
    let start = Instant::now();
    let reader = net.receiver.spawn(move || -> std::io::Result<u64> {
        let (mut conn, _) = listener.accept()?;
        conn.set_read_timeout(Some(limit))?;
        let (mut buf, mut n) = (vec![0u8; 1 << 20], 0u64);
        loop {
            match conn.read(&mut buf)? {
                0 => return Ok(n),
                k => n += k as u64,
            }
        }
    });
    net.sender
        .run(move || -> std::io::Result<()> {
            pin_current_thread(flood_cpu()).map_err(std::io::Error::from)?;
            let mut conn = TcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
            conn.set_write_timeout(Some(limit))?;
            let (chunk, mut sent) = (vec![0x6cu8; 1 << 16], 0u64);
            while sent < bytes && start.elapsed() < limit {
                conn.write_all(&chunk)?;
                sent += chunk.len() as u64;
            }
            Ok(())
        })
        .expect("namespace")
        .expect("sending");
    let read = reader.join().expect("the reader panicked").expect("namespace").expect("reading");
    (read, start.elapsed())
}
