//! A second stream beside a [`Gpu`]'s, for work that runs at once with the GPU's stream inside
//! one call: forked from the GPU's stream (it starts after everything enqueued there before) and
//! joined back before the call returns (everything after waits for it), so the one-stream rule
//! of [`crate::gpu`] still holds for everything the caller sees.
//!
//! Used by NCCL's overlapped exchange ([`crate::nccl`], the device's highest priority) and by
//! the tensor-core backward's dq and dK/dV passes where their grids are too small to fill the
//! GPU one after the other ([`Gpu::with_side_stream`]).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};

use crate::error::Result;
use crate::gpu::Gpu;
use crate::launch::map_driver_error;

/// A stream of the GPU's context and the two events that order it with the GPU's stream:
/// `ready` (what the side stream's work reads is written) and `done` (its work finished).
pub(crate) struct SideStream {
    stream: Arc<CudaStream>,
    ready: CudaEvent,
    done: CudaEvent,
}

impl SideStream {
    /// A new stream on `gpu`'s context, at the device's highest priority where `high`, and its
    /// two events.
    pub(crate) fn new(gpu: &Gpu, high: bool) -> Result<Self> {
        let ctx = gpu.context();
        let stream = if high {
            let (_, highest) = cudarc::driver::result::stream::get_priority_range()
                .map_err(|e| map_driver_error("asking for the stream priorities", e))?;
            ctx.new_stream_with_priority(highest)
        } else {
            ctx.new_stream()
        }
        .map_err(|e| map_driver_error("creating a side stream", e))?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let event = || {
            ctx.new_event(flags)
                .map_err(|e| map_driver_error("creating a side stream's event", e))
        };
        Ok(Self {
            stream,
            ready: event()?,
            done: event()?,
        })
    }

    /// The side stream, to enqueue work on between [`fork`](Self::fork) and the join.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Orders the side stream after everything enqueued on `main` so far. From here `main`
    /// waits for the side stream however the returned guard ends: by
    /// [`JoinOnDrop::join`], or when dropped (on an early return or a panic).
    pub(crate) fn fork<'a>(&'a self, main: &'a CudaStream) -> Result<JoinOnDrop<'a>> {
        self.ready
            .record(main)
            .and_then(|()| self.stream.wait(&self.ready))
            .map_err(|e| map_driver_error("ordering a side stream after the GPU's", e))?;
        Ok(JoinOnDrop {
            main,
            side: self,
            armed: true,
        })
    }
}

/// Makes the GPU's stream wait for the work forked onto a side stream, also when the work
/// enqueued meanwhile fails or panics: buffers freed on the GPU's stream afterwards are then
/// freed only once the side stream's work is done.
pub(crate) struct JoinOnDrop<'a> {
    main: &'a CudaStream,
    side: &'a SideStream,
    armed: bool,
}

impl JoinOnDrop<'_> {
    /// Joins, reporting a failure; the guard then stays armed, so its drop tries again and
    /// synchronizes where the event still cannot order the streams.
    pub(crate) fn join(mut self) -> Result<()> {
        self.try_join()?;
        self.armed = false;
        Ok(())
    }

    fn try_join(&self) -> Result<()> {
        self.side
            .done
            .record(&self.side.stream)
            .and_then(|()| self.main.wait(&self.side.done))
            .map_err(|e| map_driver_error("joining a side stream to the GPU's", e))
    }
}

impl Drop for JoinOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed && self.try_join().is_err() {
            // No event to order them: wait here, so nothing is freed under the side's work.
            let _ = self.side.stream.synchronize();
        }
    }
}
