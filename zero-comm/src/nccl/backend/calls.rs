//! How [`NcclComm`] issues a collective: the cross-rank descriptor check, the call on the
//! stream, the pending queue and its polled drain against the timeout, the mean's division.

#[allow(clippy::wildcard_imports)]
use super::*;

impl NcclComm {
    /// Pops completed collectives; with `block`, waits for all of them. A collective still
    /// running `timeout` after it was issued aborts the communicator with [`Error::Timeout`].
    pub(super) fn drain(&self, block: bool) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            let (op, issued, done) = {
                let st = self.state.borrow();
                match st.pending.front() {
                    None => return Ok(()),
                    Some(p) => (p.op, p.issued, p.event.try_is_complete()),
                }
            };
            match done {
                Ok(true) => {
                    self.state.borrow_mut().pending.pop_front();
                    continue;
                }
                Ok(false) => {}
                Err(e) => return Err(self.fail_driver(op, "waiting for completion", e)),
            }
            // Still running: an asynchronous NCCL error (a peer died) ends the wait early.
            let h = match self.state.borrow().raw.as_ref() {
                Some(r) => r.ptr(),
                None => return Ok(()),
            };
            match ffi::async_state(h) {
                Ok(sys::ncclResult_t::ncclSuccess) | Ok(sys::ncclResult_t::ncclInProgress) => {}
                Ok(e) => {
                    let m = ffi::describe("ncclCommGetAsyncError", e, h);
                    return Err(self.fail(op, Fail::Nccl(m)));
                }
                Err(f) => return Err(self.fail(op, f)),
            }
            let waited = issued.elapsed();
            if waited >= self.opts.timeout {
                return Err(self.fail(op, Fail::Timeout(waited)));
            }
            if !block {
                return Ok(());
            }
            backoff.pause();
        }
    }

    /// Calls NCCL (`f(comm, stream)`) and settles the result; any failure aborts.
    pub(super) fn call(
        &self,
        op: Op,
        name: &str,
        f: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> sys::ncclResult_t,
    ) -> Result<()> {
        let h = self.handle(op)?;
        self.bind()?;
        let started = Instant::now();
        let code = f(h, self.cu_stream());
        ffi::settle(code, name, h, started, self.opts.timeout).map_err(|e| self.fail(op, e))
    }

    /// [`Self::issue`]s the sum `raw` (`ncclReduceScatter` or `ncclAllReduce`) of `count` elements
    /// of `dtype` into `recv`, then divides them by the world size for [`ReduceOp::Mean`].
    ///
    /// # Safety
    /// As for [`Self::issue`].
    pub(super) unsafe fn reduce(
        &self,
        o: Op,
        (raw, op): (Raw, ReduceOp),
        (send, recv): (CUdeviceptr, CUdeviceptr),
        (count, dtype): (usize, DType),
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.issue(o, raw.name(), raw, (send, recv), (count, nccl_dtype(dtype))) }?;
        if op == ReduceOp::Mean {
            self.divide(o, recv, count, dtype)?;
        }
        Ok(())
    }

    /// Issues one NCCL collective (`raw`) on device addresses `send` and `recv`, `count`
    /// elements of `dtype` (for [`Raw::ReduceScatter`] the receive count), summing where it
    /// reduces; `name` names it in errors.
    ///
    /// # Safety
    /// `send` and `recv` are live memory on this communicator's device, large enough for what
    /// the call reads and writes there, and stay alive until the stream passes the call.
    pub(super) unsafe fn issue(
        &self,
        op: Op,
        name: &str,
        raw: Raw,
        (send, recv): (CUdeviceptr, CUdeviceptr),
        (count, dtype): (usize, sys::ncclDataType_t),
    ) -> Result<()> {
        let (sp, rp) = (send as *const c_void, recv as *mut c_void);
        let sum = sys::ncclRedOp_t::ncclSum;
        self.call(op, name, |h, s| {
            // SAFETY: the caller's contract above.
            unsafe {
                match raw {
                    Raw::AllGather => sys::ncclAllGather(sp, rp, count, dtype, h, s),
                    Raw::ReduceScatter => sys::ncclReduceScatter(sp, rp, count, dtype, sum, h, s),
                    Raw::AllReduce => sys::ncclAllReduce(sp, rp, count, dtype, sum, h, s),
                    Raw::Broadcast(root) => sys::ncclBroadcast(sp, rp, count, dtype, root, h, s),
                }
            }
        })
    }

    /// Validation before anything moves: with [`NcclOptions::check_peers`] (outside groups) every
    /// rank's descriptor, so every rank reaches the host loopback's verdict; else this rank's own.
    pub(super) fn begin(&self, d: &Desc) -> Result<()> {
        self.ensure_usable(d.op)?;
        let n = self.members.len();
        let in_group = self.state.borrow().group_depth > 0;
        // Also at n = 1, where it is cheap, so that one GPU exercises the path.
        if self.opts.check_peers && !in_group {
            let all = self.exchange_descs(d)?;
            validate(&all, &self.members, n)
        } else {
            validate(std::slice::from_ref(d), &[self.me()], n)
        }
    }

    /// All-gathers every rank's descriptor (control traffic, not counted in the table).
    pub(super) fn exchange_descs(&self, d: &Desc) -> Result<Vec<Desc>> {
        let op = d.op;
        let n = self.members.len();
        // The upload below synchronises the stream, so first wait (with the timeout) for whatever
        // is still running on it.
        self.drain(true)?;
        let send = self
            .stream
            .clone_htod(&d.to_bytes()[..])
            .map_err(|e| self.fail_driver(op, "uploading the call descriptor", e))?;
        let mut recv = self
            .stream
            .alloc_zeros::<u8>(DESC_BYTES * n)
            .map_err(|e| self.fail_driver(op, "allocating the descriptor exchange", e))?;
        {
            let (sp, _gs) = send.device_ptr(&self.stream);
            let (rp, _gr) = recv.device_ptr_mut(&self.stream);
            let what = "ncclAllGather (call descriptors)";
            let bytes = (DESC_BYTES, sys::ncclDataType_t::ncclUint8);
            // SAFETY: `send` holds DESC_BYTES bytes and `recv` n times that, both on this
            // communicator's device and alive until the wait below completes.
            unsafe { self.issue(op, what, Raw::AllGather, (sp, rp), bytes) }?;
        }
        self.push_pending(op)?;
        self.drain(true)?;
        let host = self
            .stream
            .clone_dtoh(&recv)
            .map_err(|e| self.fail_driver(op, "downloading the call descriptors", e))?;
        host.chunks_exact(DESC_BYTES)
            .enumerate()
            .map(|(j, b)| Desc::from_bytes(b, self.global_rank_of(j)))
            .collect::<Result<Vec<_>>>()
            .inspect_err(|e| self.abort_with(&e.to_string()))
    }

    pub(super) fn push_pending(&self, op: Op) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.fail_driver(op, "recording the completion event", e))?;
        self.state.borrow_mut().pending.push_back(Pending {
            op,
            event,
            issued: Instant::now(),
        });
        Ok(())
    }

    /// After an op was enqueued: records its traffic, then (outside groups) its completion event,
    /// waiting for it in [`WaitMode::Eager`].
    /// Records the call's bytes, counted from the counts handed to NCCL (see [`Tally`]), and
    /// waits for it as the wait mode says.
    pub(super) fn finish(&mut self, d: &Desc, tally: Tally) -> Result<()> {
        if let Some(c) = d.op.collective() {
            self.traffic
                .record(c, tally.traffic(&self.topology, &self.members));
        }
        self.issued(d.op)
    }

    /// Nothing counted yet, for one call of this communicator.
    pub(super) fn tally(&self) -> Tally {
        Tally::new(self.members.len(), self.rank)
    }

    pub(super) fn issued(&self, op: Op) -> Result<()> {
        {
            let mut st = self.state.borrow_mut();
            if st.group_depth > 0 {
                st.group_first_op.get_or_insert(op);
                return Ok(());
            }
        }
        self.push_pending(op)?;
        let many = self.state.borrow().pending.len() > MAX_PENDING;
        match self.opts.wait {
            WaitMode::Eager => self.drain(true),
            WaitMode::Lazy => self.drain(many),
        }
    }

    /// `Mean` = NCCL `Sum`, then this division, in stream order (after the group inside one).
    pub(super) fn divide(&self, op: Op, ptr: CUdeviceptr, len: usize, dtype: DType) -> Result<()> {
        {
            let mut st = self.state.borrow_mut();
            if st.group_depth > 0 {
                st.deferred.push(Deferred { ptr, len, dtype });
                return Ok(());
            }
        }
        let n = self.members.len() as f32;
        self.kernels
            .divide(&self.ctx, &self.stream, ptr, len, dtype, n)
            .map_err(|e| {
                let e = Error::Backend(format!("{op} on rank {}: {e}", self.me()));
                self.abort_with(&e.to_string());
                e
            })
    }

    pub(super) fn check_buffer<E: Element>(&self, op: Op, b: &NcclBuffer<E>) -> Result<()> {
        if b.bytes.ordinal() != self.ctx.ordinal() {
            return Err(Error::Backend(format!(
                "nccl: {op} on rank {}: a buffer lives on cuda:{}, the communicator on cuda:{}",
                self.me(),
                b.bytes.ordinal(),
                self.ctx.ordinal()
            )));
        }
        Ok(())
    }

    pub(super) fn all_gather_impl<E: Element>(
        &mut self,
        send: Option<&NcclBuffer<E>>,
        recv: &mut NcclBuffer<E>,
    ) -> Result<()> {
        let op = Op::from(Collective::AllGather);
        let n = self.members.len();
        let in_place = send.is_none();
        let chunk = match send {
            Some(s) => s.len,
            None => recv.len / n,
        };
        let d = Desc {
            in_place,
            ..Desc::of(op, E::DTYPE, chunk, recv.len)
        };
        self.begin(&d)?;
        if let Some(s) = send {
            self.check_buffer(op, s)?;
        }
        self.check_buffer(op, recv)?;
        let mut tally = self.tally();
        if chunk > 0 {
            let offset = (self.rank * chunk * size_of::<E>()) as u64;
            let guard_s = send.map(|s| s.bytes.device_ptr(&self.stream));
            let (rp, _gr) = recv.bytes.device_ptr_mut(&self.stream);
            let sp = guard_s.as_ref().map_or(rp + offset, |(p, _)| *p);
            let count = (chunk, nccl_dtype(E::DTYPE));
            let raw = Raw::AllGather;
            // SAFETY: lengths validated: `send` holds `chunk` elements (in place: at
            // `rank · chunk` inside `recv`, NCCL's in-place layout) and `recv` `n · chunk`;
            // both stay alive and stream-ordered on this communicator's stream.
            unsafe { self.issue(op, raw.name(), raw, (sp, rp), count) }?;
            let eb = size_of::<E>();
            tally.all_gather(chunk * eb, n * chunk * eb);
        }
        self.finish(&d, tally)
    }
}
