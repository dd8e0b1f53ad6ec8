//! [`TcpExchange`]: one process per rank, a full mesh of TCP connections set up through a
//! rendezvous at rank 0's address (torchrun's `MASTER_ADDR:MASTER_PORT`).
//!
//! Rendezvous: rank 0 listens on the master address; every other rank opens a listener of its
//! own (any free port), connects to rank 0 and says `(rank, world, port)`; once all have, rank
//! 0 sends everyone the table of `(address, port)` and its connection becomes the link to rank
//! 0. Then rank j connects to every rank i with 0 < i < j and says its rank. Frames are
//! little-endian: a u64 byte length, then the bytes; a collective's frames start with its number
//! and the element size, so ranks out of step get an error, not each other's data. A failed
//! collective shuts every link down (peers blocked on this rank get an error too) and the
//! exchange refuses later ones.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytemuck::Pod;

use super::Exchange;
use crate::error::{Error, Result};

/// The exchange of one rank among processes (one per rank, any hosts), over TCP.
#[derive(Debug)]
pub struct TcpExchange {
    rank: usize,
    world: usize,
    /// The link to every other rank (`None` at this rank's own index): a handle to write and
    /// one to read the same connection, so a rank's sender and receiver never wait on each
    /// other.
    links: Vec<Option<Link>>,
    /// One collective at a time (frames of two would interleave).
    collective: Mutex<()>,
    /// The number of the next collective, sent in every frame: ranks out of step are an error.
    seq: AtomicU64,
    /// Why the exchange stopped working (a failed collective shuts every link down).
    broken: Mutex<Option<String>>,
}

#[derive(Debug)]
struct Link {
    write: Mutex<TcpStream>,
    read: Mutex<TcpStream>,
    /// A third handle, never locked: shutting it down unblocks the other two.
    control: TcpStream,
}

impl Link {
    fn new(s: TcpStream, rank: usize) -> Result<Self> {
        let clone = || {
            s.try_clone()
                .map_err(|e| io_err(format!("the link to rank {rank}"), e))
        };
        let (read, control) = (clone()?, clone()?);
        Ok(Self {
            write: Mutex::new(s),
            read: Mutex::new(read),
            control,
        })
    }
}

fn io_err(what: String, e: std::io::Error) -> Error {
    Error::Exchange {
        why: format!("{what}: {e}"),
    }
}

fn write_frame(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)?;
    s.flush()
}

/// The element type's tag in a collective's frames: FNV-1a of its name and its size (the same
/// in every process of one program).
fn type_tag<T>() -> u64 {
    let name = std::any::type_name::<T>().bytes();
    let h = name.fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    h ^ std::mem::size_of::<T>() as u64
}

/// A collective's frame: the collective's number and the element type's tag, then the bytes.
fn write_data(s: &mut TcpStream, seq: u64, tag: u64, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&words(&[seq, tag]))?;
    write_frame(s, bytes)
}

/// Reads a collective's frame, checking that the sender is at the same collective with the same
/// element type.
fn read_data(s: &mut TcpStream, seq: u64, tag: u64) -> std::io::Result<Vec<u8>> {
    let mut head = [0u8; 16];
    s.read_exact(&mut head)?;
    let head = unwords(&head);
    if head[..] != [seq, tag] {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "the sender is at collective {} (element tag {:#x}), this rank at collective \
                 {seq} (tag {tag:#x}): ranks must call the same collectives in the same order",
                head[0], head[1]
            ),
        ));
    }
    read_frame(s, u64::MAX)
}

fn read_frame(s: &mut TcpStream, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes announced, more than the {limit} expected"),
        ));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(len as usize).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::OutOfMemory,
            format!("cannot allocate {len} bytes for a frame"),
        )
    })?;
    buf.resize(len as usize, 0);
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn words(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn unwords(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            u64::from_le_bytes(w)
        })
        .collect()
}

/// Connects to `addr`, retrying until `deadline` (the listener may not be up yet).
fn connect_until(addr: SocketAddr, deadline: Instant, waited_for: &str) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(s) => {
                s.set_nodelay(true)
                    .map_err(|e| io_err(format!("{addr}"), e))?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(Error::Exchange {
                    why: format!("rendezvous with {waited_for} ({addr}) timed out: {e}"),
                })
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Bounds reads on `s` by `deadline` (a connection that says nothing cannot stall the
/// rendezvous).
fn until(s: &TcpStream, deadline: Instant) -> Result<()> {
    s.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))
    .map_err(|e| io_err("rendezvous".into(), e))
}

/// Accepts one connection before `deadline`.
fn accept_until(l: &TcpListener, deadline: Instant, what: &str) -> Result<TcpStream> {
    l.set_nonblocking(true)
        .map_err(|e| io_err(what.to_string(), e))?;
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)
                    .and_then(|()| s.set_nodelay(true))
                    .map_err(|e| io_err(what.to_string(), e))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let at = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
                    return Err(Error::Exchange {
                        why: format!("rendezvous: {what} on {at} timed out"),
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(io_err(what.to_string(), e)),
        }
    }
}

impl TcpExchange {
    /// Joins the world of `world` ranks as `rank`, with rank 0 at `master` (`host:port`);
    /// every rank must call it, within `timeout` of each other.
    ///
    /// Errors: [`Error::RankOutOfRange`], [`Error::InvalidConfig`] for an address that does
    /// not resolve, [`Error::Exchange`] naming the address waited on when the rendezvous times
    /// out or a rank disagrees on the world's size.
    pub fn connect(rank: usize, world: usize, master: &str, timeout: Duration) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(Error::RankOutOfRange { rank, world });
        }
        let addr = master
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::InvalidConfig {
                what: "master address",
                why: format!("{master:?} does not resolve to host:port"),
            })?;
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<Link>> = (0..world).map(|_| None).collect();
        let done = |links| Self {
            rank,
            world,
            links,
            collective: Mutex::new(()),
            seq: AtomicU64::new(0),
            broken: Mutex::new(None),
        };
        if world == 1 {
            return Ok(done(links));
        }
        // The largest rendezvous frame: rank 0's table, 3 words per rank.
        let limit = 24 * world as u64 + 64;
        if rank == 0 {
            let l = TcpListener::bind(SocketAddr::new(unspecified(addr.ip()), addr.port()))
                .map_err(|e| {
                    io_err(
                        format!("listening on port {} (all interfaces)", addr.port()),
                        e,
                    )
                })?;
            let mut table = vec![0u64; 3 * world];
            let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
            for _ in 1..world {
                let mut s = accept_until(&l, deadline, "waiting for the other ranks")?;
                until(&s, deadline)?;
                let hello = unwords(
                    &read_frame(&mut s, limit).map_err(|e| io_err("rendezvous".into(), e))?,
                );
                let (r, w, port) = match hello[..] {
                    [r, w, p] => (r as usize, w as usize, p),
                    _ => {
                        return Err(Error::Exchange {
                            why: "rendezvous: a malformed hello".into(),
                        })
                    }
                };
                if w != world || r == 0 || r >= world || streams[r].is_some() {
                    return Err(Error::Exchange {
                        why: format!(
                            "rendezvous on {addr}: rank {r} of a world of {w} joined a world of \
                             {world} (or twice)"
                        ),
                    });
                }
                let ip = s
                    .peer_addr()
                    .map_err(|e| io_err("rendezvous".into(), e))?
                    .ip();
                let (hi, lo) = ip_words(ip);
                table[3 * r] = hi;
                table[3 * r + 1] = lo;
                table[3 * r + 2] = port;
                s.set_read_timeout(None)
                    .map_err(|e| io_err("rendezvous".into(), e))?;
                streams[r] = Some(s);
            }
            let bytes = words(&table);
            for (r, s) in streams.into_iter().enumerate() {
                if let Some(mut s) = s {
                    write_frame(&mut s, &bytes)
                        .map_err(|e| io_err(format!("rendezvous with rank {r}"), e))?;
                    links[r] = Some(Link::new(s, r)?);
                }
            }
        } else {
            let own = TcpListener::bind(SocketAddr::new(unspecified(addr.ip()), 0))
                .map_err(|e| io_err("opening this rank's listener".into(), e))?;
            let port = own
                .local_addr()
                .map_err(|e| io_err("opening this rank's listener".into(), e))?
                .port();
            let mut s = connect_until(addr, deadline, "MASTER_ADDR:MASTER_PORT")?;
            write_frame(
                &mut s,
                &words(&[rank as u64, world as u64, u64::from(port)]),
            )
            .map_err(|e| io_err(format!("rendezvous with {addr}"), e))?;
            s.set_read_timeout(Some(
                deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            ))
            .map_err(|e| io_err(format!("rendezvous with {addr}"), e))?;
            let table = unwords(&read_frame(&mut s, limit).map_err(|e| {
                io_err(
                    format!("rendezvous with {addr} (waiting for every rank)"),
                    e,
                )
            })?);
            s.set_read_timeout(None)
                .map_err(|e| io_err(format!("rendezvous with {addr}"), e))?;
            if table.len() != 3 * world {
                return Err(Error::Exchange {
                    why: format!(
                        "rendezvous with {addr}: a table of {} words for a world of {world}",
                        table.len()
                    ),
                });
            }
            links[0] = Some(Link::new(s, 0)?);
            // Connect to the ranks below, then accept the ranks above.
            for (i, link) in links.iter_mut().enumerate().take(rank).skip(1) {
                let ip = words_ip(table[3 * i], table[3 * i + 1]);
                let peer = SocketAddr::new(ip, table[3 * i + 2] as u16);
                let mut c = connect_until(peer, deadline, &format!("rank {i}"))?;
                write_frame(&mut c, &words(&[rank as u64]))
                    .map_err(|e| io_err(format!("connecting to rank {i}"), e))?;
                *link = Some(Link::new(c, i)?);
            }
            for _ in rank + 1..world {
                let mut c = accept_until(&own, deadline, "waiting for the ranks above this one")?;
                until(&c, deadline)?;
                let from = unwords(&read_frame(&mut c, 64).map_err(|e| io_err("mesh".into(), e))?);
                c.set_read_timeout(None)
                    .map_err(|e| io_err("mesh".into(), e))?;
                match from[..] {
                    [j] if (j as usize) > rank
                        && (j as usize) < world
                        && links[j as usize].is_none() =>
                    {
                        links[j as usize] = Some(Link::new(c, j as usize)?);
                    }
                    _ => {
                        return Err(Error::Exchange {
                            why: format!("mesh: an unexpected hello {from:?} at rank {rank}"),
                        })
                    }
                }
            }
        }
        Ok(done(links))
    }

    /// Joins the world described by the environment torchrun sets: `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR`; rank 0 listens on `SPATTN_MASTER_PORT`, by default `MASTER_PORT + 1`
    /// (torchrun's own store holds `MASTER_PORT`); the rendezvous waits
    /// `SPATTN_RENDEZVOUS_TIMEOUT` seconds (default 300).
    ///
    /// Errors: as [`from_vars`](Self::from_vars).
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) with the variables looked up by `get` (a launcher's own
    /// table, or tests).
    ///
    /// Errors: [`Error::InvalidConfig`] naming a variable that is missing or not a number; as
    /// [`connect`](Self::connect).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |name: &'static str| {
            get(name).ok_or_else(|| Error::InvalidConfig {
                what: name,
                why: "not set (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)".into(),
            })
        };
        let num = |name: &'static str| -> Result<usize> {
            let v = var(name)?;
            v.trim().parse().map_err(|_| Error::InvalidConfig {
                what: name,
                why: format!("{v:?} is not a non-negative integer"),
            })
        };
        let (rank, world) = (num("RANK")?, num("WORLD_SIZE")?);
        let port = match get("SPATTN_MASTER_PORT") {
            Some(_) => num("SPATTN_MASTER_PORT")?,
            None => num("MASTER_PORT")? + 1,
        };
        let master = format!("{}:{port}", var("MASTER_ADDR")?);
        let timeout = match get("SPATTN_RENDEZVOUS_TIMEOUT") {
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .ok_or_else(|| Error::InvalidConfig {
                    what: "SPATTN_RENDEZVOUS_TIMEOUT",
                    why: format!("{v:?} is not a positive number of seconds"),
                })?,
            None => 300.0,
        };
        Self::connect(rank, world, &master, Duration::from_secs_f64(timeout))
    }
}

fn unspecified(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    }
}

/// An address as two words (IPv4 mapped into IPv6).
fn ip_words(ip: IpAddr) -> (u64, u64) {
    let v6 = match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    let b = u128::from(v6);
    ((b >> 64) as u64, b as u64)
}

fn words_ip(hi: u64, lo: u64) -> IpAddr {
    let v6 = std::net::Ipv6Addr::from((u128::from(hi) << 64) | u128::from(lo));
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

impl Exchange for TcpExchange {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_to_all<T: Pod + Send>(&self, mut send: Vec<Vec<T>>) -> Result<Vec<Vec<T>>> {
        if send.len() != self.world {
            return Err(Error::WorldMismatch {
                what: "all_to_all blocks",
                expected: self.world,
                actual: send.len(),
            });
        }
        let _one = self
            .collective
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(why) = self
            .broken
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Err(Error::Exchange { why });
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let result = self.exchange(seq, &mut send);
        if let Err(e) = &result {
            // Unblock every peer waiting on this rank, and refuse later collectives.
            for link in self.links.iter().flatten() {
                let _ = link.control.shutdown(Shutdown::Both);
            }
            self.broken
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_or_insert_with(|| format!("a collective failed earlier: {e}"));
        }
        result
    }
}

impl TcpExchange {
    /// One all-to-all, collective number `seq`.
    fn exchange<T: Pod + Send>(&self, seq: u64, send: &mut [Vec<T>]) -> Result<Vec<Vec<T>>> {
        let own = std::mem::take(&mut send[self.rank]);
        let elem = std::mem::size_of::<T>().max(1);
        let tag = type_tag::<T>();
        // Writers run beside the reader, so two ranks sending each other large blocks never
        // both block in write; a failure shuts the links down (see `all_to_all`), which
        // unblocks any writer still waiting.
        std::thread::scope(|s| -> Result<Vec<Vec<T>>> {
            let writers: Vec<_> = send
                .iter()
                .enumerate()
                .filter(|&(d, _)| d != self.rank)
                .map(|(d, block)| {
                    let link = self.links[d].as_ref();
                    let bytes: &[u8] = bytemuck::cast_slice(block);
                    s.spawn(move || -> Result<()> {
                        let link = link.ok_or_else(|| Error::Exchange {
                            why: format!("no link to rank {d}"),
                        })?;
                        let mut stream = link.write.lock().unwrap_or_else(PoisonError::into_inner);
                        let r = write_data(&mut stream, seq, tag, bytes)
                            .map_err(|e| io_err(format!("sending to rank {d}"), e));
                        if r.is_err() {
                            let _ = link.control.shutdown(Shutdown::Both);
                        }
                        r
                    })
                })
                .collect();
            let received = (|| -> Result<Vec<Vec<T>>> {
                let mut recv = Vec::with_capacity(self.world);
                for src in 0..self.world {
                    if src == self.rank {
                        recv.push(Vec::new());
                        continue;
                    }
                    let link = self.links[src].as_ref().ok_or_else(|| Error::Exchange {
                        why: format!("no link to rank {src}"),
                    })?;
                    let mut stream = link.read.lock().unwrap_or_else(PoisonError::into_inner);
                    let bytes = read_data(&mut stream, seq, tag)
                        .map_err(|e| io_err(format!("receiving from rank {src}"), e))?;
                    if bytes.len() % elem != 0 {
                        return Err(Error::Exchange {
                            why: format!(
                                "rank {src} sent {} bytes, not whole elements of {elem}",
                                bytes.len()
                            ),
                        });
                    }
                    let mut block: Vec<T> = vec![T::zeroed(); bytes.len() / elem];
                    bytemuck::cast_slice_mut::<T, u8>(&mut block).copy_from_slice(&bytes);
                    recv.push(block);
                }
                Ok(recv)
            })();
            if received.is_err() {
                // Writers to peers that stopped reading would wait forever: cut the links.
                for link in self.links.iter().flatten() {
                    let _ = link.control.shutdown(Shutdown::Both);
                }
            }
            let mut first_err = None;
            for w in writers {
                let r = w.join().unwrap_or_else(|_| {
                    Err(Error::Exchange {
                        why: "a sending thread panicked".into(),
                    })
                });
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            let mut recv = received?;
            if let Some(e) = first_err {
                return Err(e);
            }
            recv[self.rank] = own;
            Ok(recv)
        })
    }
}
