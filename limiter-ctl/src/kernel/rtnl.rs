//! Questions to the kernel over rtnetlink: a request, and every message of its answer (a dump
//! runs over several datagrams, up to NLMSG_DONE). What the XDP hook holds (`pins`) and the
//! filters at tc ingress (`tc_filter`) are asked this way.

use std::io;

use netlink_packet_core::{NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

/// Sends `message` (a dump if `dump`) and returns what the kernel answered, in order. An error
/// the kernel answers is returned as its errno.
pub(super) fn ask(message: RouteNetlinkMessage, dump: bool) -> io::Result<Vec<RouteNetlinkMessage>> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut request = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(message));
    request.header.flags = NLM_F_REQUEST | if dump { NLM_F_DUMP } else { 0 };
    request.header.sequence_number = 1;
    request.finalize();
    let mut buf = vec![0; request.buffer_len()];
    request.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let mut answer = Vec::new();
    loop {
        let (datagram, _) = socket.recv_from_full()?;
        let mut at = 0;
        while at < datagram.len() {
            let reply =
                NetlinkMessage::<RouteNetlinkMessage>::deserialize(&datagram[at..]).map_err(io::Error::other)?;
            let length = reply.header.length as usize;
            match reply.payload {
                NetlinkPayload::InnerMessage(inner) if dump => answer.push(inner),
                NetlinkPayload::InnerMessage(inner) => return Ok(vec![inner]),
                NetlinkPayload::Done(_) => return Ok(answer),
                NetlinkPayload::Error(e) if e.code.is_some() => return Err(e.to_io()),
                // An acknowledgement: nothing more comes.
                NetlinkPayload::Error(_) => return Ok(answer),
                NetlinkPayload::Noop | NetlinkPayload::Overrun(_) => {}
                _ => {}
            }
            if length == 0 {
                break;
            }
            // Messages are aligned to 4 bytes.
            at += length.div_ceil(4) * 4;
        }
    }
}
