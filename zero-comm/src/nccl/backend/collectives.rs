//! The [`Communicator`] contract of [`NcclComm`]: buffers, the collectives, split and groups.

#[allow(clippy::wildcard_imports)]
use super::*;

impl Communicator for NcclComm {
    type Buffer<E: Element> = NcclBuffer<E>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn global_rank(&self) -> usize {
        self.me()
    }

    fn members(&self) -> &[usize] {
        &self.members
    }

    fn topology(&self) -> &Topology {
        &self.topology
    }

    fn alloc<E: Element>(&self, len: usize) -> Result<NcclBuffer<E>> {
        NcclBuffer::zeroed(&self.stream, len)
    }

    fn upload<E: Element>(&self, src: &[E]) -> Result<NcclBuffer<E>> {
        let mut buf = self.alloc::<E>(src.len())?;
        if !src.is_empty() {
            // A copy from pageable memory synchronises the stream: wait for it with a timeout
            // first, so a hung collective cannot block the copy forever.
            self.drain(true)?;
            buf.write(&self.stream, src)?;
        }
        Ok(buf)
    }

    fn upload_into<E: Element>(&self, src: &[E], dst: &mut NcclBuffer<E>) -> Result<()> {
        if src.len() != dst.len {
            return Err(Error::BufferLength {
                what: "upload_into",
                buffer: dst.len,
                host: src.len(),
            });
        }
        if src.is_empty() {
            return Ok(());
        }
        // As in `upload`: the copy synchronises the stream, so first wait with a timeout.
        self.drain(true)?;
        dst.write(&self.stream, src)
    }

    fn download<E: Element>(&self, buf: &NcclBuffer<E>, dst: &mut [E]) -> Result<()> {
        if dst.len() != buf.len {
            return Err(Error::BufferLength {
                what: "download",
                buffer: buf.len,
                host: dst.len(),
            });
        }
        self.drain(true)?;
        buf.read(&self.stream, dst)
    }

    fn buffer_len<E: Element>(&self, buf: &NcclBuffer<E>) -> usize {
        buf.len
    }

    fn all_gather<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        self.all_gather_impl(Some(send), recv)
    }

    fn all_gather_in_place<E: Element>(&mut self, buf: &mut NcclBuffer<E>) -> Result<()> {
        self.all_gather_impl(None, buf)
    }

    fn reduce_scatter<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
        op: ReduceOp,
    ) -> Result<()> {
        let o = Op::from(Collective::ReduceScatter);
        let d = Desc::of(o, E::DTYPE, send.len, recv.len).reduce(op);
        self.begin(&d)?;
        self.check_buffer(o, send)?;
        self.check_buffer(o, recv)?;
        let c = recv.len;
        let mut tally = self.tally();
        if c > 0 {
            let (sp, _gs) = send.bytes.device_ptr(&self.stream);
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            // SAFETY: validated `send = n · c`, `recv = c`; distinct live buffers on this
            // communicator's stream.
            unsafe { self.reduce(o, (Raw::ReduceScatter, op), (sp, rp), (c, E::DTYPE)) }?;
            tally.reduce_scatter(c * size_of::<E>());
        }
        self.finish(&d, tally)
    }

    fn all_reduce<E: Element>(&mut self, buf: &mut NcclBuffer<E>, op: ReduceOp) -> Result<()> {
        let o = Op::from(Collective::AllReduce);
        let len = buf.len;
        let d = Desc::of(o, E::DTYPE, len, len).reduce(op);
        self.begin(&d)?;
        self.check_buffer(o, buf)?;
        let mut tally = self.tally();
        if len > 0 {
            let (p, _g) = buf.bytes.device_ptr_mut(&self.stream);
            // SAFETY: in place on `len` live elements on this communicator's stream.
            unsafe { self.reduce(o, (Raw::AllReduce, op), (p, p), (len, E::DTYPE)) }?;
            tally.all_reduce(len, size_of::<E>());
        }
        self.finish(&d, tally)
    }

    fn broadcast<E: Element>(&mut self, buf: &mut NcclBuffer<E>, root: usize) -> Result<()> {
        let o = Op::from(Collective::Broadcast);
        let len = buf.len;
        let d = Desc::of(o, E::DTYPE, len, len).root(root);
        self.begin(&d)?;
        self.check_buffer(o, buf)?;
        let mut tally = self.tally();
        if len > 0 {
            // `root < n ≤ i32::MAX` after validation and init.
            let r = root as c_int;
            let (p, _g) = buf.bytes.device_ptr_mut(&self.stream);
            let count = (len, nccl_dtype(E::DTYPE));
            let raw = Raw::Broadcast(r);
            // SAFETY: in place on `len` live elements on this communicator's stream.
            unsafe { self.issue(o, raw.name(), raw, (p, p), count) }?;
            tally.broadcast(root, len * size_of::<E>());
        }
        self.finish(&d, tally)
    }

    fn all_to_all<E: Element>(
        &mut self,
        send: &NcclBuffer<E>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        let o = Op::from(Collective::AllToAll);
        let d = Desc::of(o, E::DTYPE, send.len, recv.len);
        self.begin(&d)?;
        self.check_buffer(o, send)?;
        self.check_buffer(o, recv)?;
        let n = self.members.len();
        let c = send.len / n;
        let mut tally = self.tally();
        if c > 0 {
            let eb = size_of::<E>();
            let cb = (c * eb) as u64;
            let me = self.rank;
            let (sp, _gs) = send.bytes.device_ptr(&self.stream);
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            self.bind()?;
            // Own chunk: a device copy, stream-ordered like the rest.
            // SAFETY: both ranges lie inside their (validated) buffers and do not overlap.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    rp + me as u64 * cb,
                    sp + me as u64 * cb,
                    c * eb,
                    self.stream.cu_stream(),
                )
            }
            .map_err(|e| self.fail_driver(o, "copying the own chunk", e))?;
            if n > 1 {
                let h = self.handle(o)?;
                let started = Instant::now();
                let dt = nccl_dtype(E::DTYPE);
                let stream = self.cu_stream();
                // SAFETY: group calls are thread-local bookkeeping.
                let start = unsafe { sys::ncclGroupStart() };
                ffi::settle(start, "ncclGroupStart", h, started, self.opts.timeout)
                    .map_err(|f| self.fail(o, f))?;
                let mut first: Option<(&str, sys::ncclResult_t)> = None;
                for j in (0..n).filter(|&j| j != me) {
                    let peer = j as c_int;
                    let off = j as u64 * cb;
                    // SAFETY: chunk `j` of each buffer is in bounds (validated lengths); the
                    // buffers outlive the group, which ends below.
                    let s = unsafe {
                        sys::ncclSend((sp + off) as *const c_void, c, dt, peer, h, stream)
                    };
                    // SAFETY: as above.
                    let r =
                        unsafe { sys::ncclRecv((rp + off) as *mut c_void, c, dt, peer, h, stream) };
                    tally.add(j, cb, cb);
                    for (name, code) in [("ncclSend", s), ("ncclRecv", r)] {
                        // Inside a group a call only queues; `ncclGroupEnd` reports progress.
                        let queued = matches!(
                            code,
                            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                        );
                        if !queued && first.is_none() {
                            first = Some((name, code));
                        }
                    }
                }
                // SAFETY: closes the group opened above, whatever happened inside it.
                let end = unsafe { sys::ncclGroupEnd() };
                if let Some((name, code)) = first {
                    return Err(self.fail(o, Fail::Nccl(ffi::describe(name, code, h))));
                }
                ffi::settle(
                    end,
                    "ncclGroupEnd (all-to-all)",
                    h,
                    started,
                    self.opts.timeout,
                )
                .map_err(|f| self.fail(o, f))?;
            }
        }
        self.finish(&d, tally)
    }

    fn barrier(&mut self) -> Result<()> {
        let o = Op::from(Collective::Barrier);
        let d = Desc::new(o);
        self.begin(&d)?;
        if self.state.borrow().group_depth > 0 {
            return Err(Error::Backend("nccl: barrier inside a group".into()));
        }
        let mut one = self
            .stream
            .alloc_zeros::<u8>(1)
            .map_err(|e| self.fail_driver(o, "allocating the barrier byte", e))?;
        {
            let (p, _g) = one.device_ptr_mut(&self.stream);
            let byte = (1, sys::ncclDataType_t::ncclUint8);
            let name = "ncclAllReduce (barrier)";
            // SAFETY: one live byte on this communicator's stream.
            unsafe { self.issue(o, name, Raw::AllReduce, (p, p), byte) }?;
        }
        // Its byte is a signal, not payload: the plan books a barrier's call and no bytes.
        self.finish(&d, self.tally())?;
        // A barrier returns only once every rank arrived, whatever the wait mode.
        self.drain(true)
    }

    fn split(&mut self, color: usize, key: usize) -> Result<NcclComm> {
        let op = Op::Split;
        self.ensure_usable(op)?;
        if self.state.borrow().group_depth > 0 {
            return Err(Error::Backend("nccl: split inside a group".into()));
        }
        let libs = ffi::libs()?;
        if !libs.split {
            let (a, b, c) = libs.version;
            return Err(Error::Backend(format!(
                "nccl: split needs ncclCommSplit (NCCL 2.18 or newer); the loaded libnccl is {a}.{b}.{c}"
            )));
        }
        let n = self.members.len();
        let d = Desc {
            color,
            key,
            ..Desc::new(op)
        };
        // Every rank needs every rank's (color, key) to know its new group's members.
        let all = self.exchange_descs(&d)?;
        validate(&all, &self.members, n)?;
        let limit = i32::MAX as usize;
        if let Some(j) = all.iter().position(|c| c.color > limit || c.key > limit) {
            return Err(Error::Backend(format!(
                "nccl: split: rank {} passed color {} and key {}; NCCL takes values up to {limit}",
                self.global_rank_of(j),
                all[j].color,
                all[j].key
            )));
        }
        let mut group: Vec<usize> = (0..n).filter(|&j| all[j].color == color).collect();
        group.sort_by_key(|&j| (all[j].key, j));
        let new_rank = group
            .iter()
            .position(|&j| j == self.rank)
            .ok_or_else(|| Error::Backend("nccl: split lost this rank".into()))?;
        let members: Arc<[usize]> = group.iter().map(|&j| self.members[j]).collect();

        let h = self.handle(op)?;
        self.bind()?;
        let raw = ffi::split(h, color as c_int, key as c_int, self.opts.timeout)
            .map_err(|f| self.fail(op, f))?;
        let (count, user_rank) = ffi::count_and_rank(raw.ptr()).map_err(|f| self.fail(op, f))?;
        if (count, user_rank) != (members.len(), new_rank) {
            let m = format!(
                "ncclCommSplit made rank {user_rank} of {count}, expected rank {new_rank} of {} \
                 (members {members:?})",
                members.len()
            );
            return Err(self.fail(op, Fail::Nccl(m)));
        }
        Ok(NcclComm {
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
            kernels: self.kernels.clone(),
            world: self.world.clone(),
            state: RefCell::new(State {
                raw: Some(raw),
                ..State::default()
            }),
            rank: new_rank,
            members,
            topology: self.topology,
            opts: self.opts.clone(),
            nonblocking: self.nonblocking,
            traffic: TrafficTable::new(),
        })
    }

    fn traffic(&self) -> &TrafficTable {
        &self.traffic
    }

    fn abort(&mut self, cause: String) {
        self.abort_with(&cause);
    }

    fn group_start(&mut self) -> Result<()> {
        // SAFETY: thread-local bookkeeping in NCCL; the library is loaded (a communicator exists).
        let code = unsafe { sys::ncclGroupStart() };
        if code != sys::ncclResult_t::ncclSuccess {
            return Err(Error::Backend(format!(
                "nccl: {}",
                ffi::describe("ncclGroupStart", code, std::ptr::null_mut())
            )));
        }
        let mut st = self.state.borrow_mut();
        st.group_depth += 1;
        Ok(())
    }

    fn group_end(&mut self) -> Result<()> {
        let (outermost, op) = {
            let mut st = self.state.borrow_mut();
            if st.group_depth == 0 {
                return Err(Error::Backend("nccl: group_end without group_start".into()));
            }
            st.group_depth -= 1;
            let outermost = st.group_depth == 0;
            let op = if outermost {
                st.group_first_op.take()
            } else {
                st.group_first_op
            };
            (outermost, op)
        };
        let started = Instant::now();
        let _ = self.bind();
        // SAFETY: closes the group opened by `group_start`.
        let code = unsafe { sys::ncclGroupEnd() };
        let report = op.unwrap_or(Op::Collective(Collective::Barrier));
        let h = self
            .state
            .borrow()
            .raw
            .as_ref()
            .map_or(std::ptr::null_mut(), RawComm::ptr);
        let mut result = ffi::settle(code, "ncclGroupEnd", h, started, self.opts.timeout)
            .map_err(|f| self.fail(report, f));
        if outermost {
            // An abort requested inside the group takes effect now that NCCL is done with it.
            let (late_abort, deferred) = {
                let mut st = self.state.borrow_mut();
                let late = st.aborted.is_some().then(|| st.raw.take());
                (late, std::mem::take(&mut st.deferred))
            };
            if let Some(raw) = late_abort {
                drop(raw);
                if result.is_ok()
                    && let Some(cause) = self.state.borrow().aborted.clone()
                {
                    result = Err(self.aborted_err(report, cause));
                }
            }
            if result.is_ok() {
                for Deferred { ptr, len, dtype } in deferred {
                    result = self.divide(report, ptr, len, dtype);
                    if result.is_err() {
                        break;
                    }
                }
            }
            if result.is_ok() && op.is_some() {
                result = self.issued(report);
            }
        }
        result
    }
}
