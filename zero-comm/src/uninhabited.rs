//! [`Communicator`](crate::Communicator) for the stand-ins of backends that are not compiled in
//! (candle's dummy-backend pattern): types with an `Infallible` field `never`, so no value exists
//! and every method is unreachable by construction.

/// Implements [`Communicator`](crate::Communicator) for `$comm` (a struct with a field
/// `never: Infallible`) with buffers `$buf<E>`.
#[cfg_attr(all(feature = "nccl", feature = "mpi"), allow(unused_macros))]
macro_rules! uninhabited_communicator {
    ($comm:ty, $buf:ident) => {
        impl $crate::communicator::Communicator for $comm {
            type Buffer<E: $crate::element::Element> = $buf<E>;

            fn rank(&self) -> usize {
                match self.never {}
            }

            fn world_size(&self) -> usize {
                match self.never {}
            }

            fn global_rank(&self) -> usize {
                match self.never {}
            }

            fn members(&self) -> &[usize] {
                match self.never {}
            }

            fn topology(&self) -> &zero_core::Topology {
                match self.never {}
            }

            fn alloc<E: $crate::element::Element>(
                &self,
                _len: usize,
            ) -> $crate::error::Result<$buf<E>> {
                match self.never {}
            }

            fn upload<E: $crate::element::Element>(
                &self,
                _src: &[E],
            ) -> $crate::error::Result<$buf<E>> {
                match self.never {}
            }

            fn download<E: $crate::element::Element>(
                &self,
                _buf: &$buf<E>,
                _dst: &mut [E],
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn upload_into<E: $crate::element::Element>(
                &self,
                _src: &[E],
                _dst: &mut $buf<E>,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn buffer_len<E: $crate::element::Element>(&self, _buf: &$buf<E>) -> usize {
                match self.never {}
            }

            fn all_gather<E: $crate::element::Element>(
                &mut self,
                _send: &$buf<E>,
                _recv: &mut $buf<E>,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn all_gather_in_place<E: $crate::element::Element>(
                &mut self,
                _buf: &mut $buf<E>,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn reduce_scatter<E: $crate::element::Element>(
                &mut self,
                _send: &$buf<E>,
                _recv: &mut $buf<E>,
                _op: $crate::element::ReduceOp,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn all_reduce<E: $crate::element::Element>(
                &mut self,
                _buf: &mut $buf<E>,
                _op: $crate::element::ReduceOp,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn broadcast<E: $crate::element::Element>(
                &mut self,
                _buf: &mut $buf<E>,
                _root: usize,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn all_to_all<E: $crate::element::Element>(
                &mut self,
                _send: &$buf<E>,
                _recv: &mut $buf<E>,
            ) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn barrier(&mut self) -> $crate::error::Result<()> {
                match self.never {}
            }

            fn split(&mut self, _color: usize, _key: usize) -> $crate::error::Result<Self> {
                match self.never {}
            }

            fn traffic(&self) -> &zero_core::TrafficTable {
                match self.never {}
            }

            fn abort(&mut self, _cause: String) {
                match self.never {}
            }
        }
    };
}

#[cfg(any(not(feature = "nccl"), not(feature = "mpi")))]
pub(crate) use uninhabited_communicator;
