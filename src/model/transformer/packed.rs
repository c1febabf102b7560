//! Packed windows: several examples in one window of tokens, each attending only to itself and
//! counting its positions from 0 (torchtune's packed datasets: a block-diagonal causal mask and
//! position resets). The data marks each token with its example's slot in the window inside the
//! input ids (`id + vocab × slot`, slots from 0), so that a packed batch travels as plain ids
//! through sharding, DDP and FSDP; the embedding splits them and leaves the mask and positions,
//! built once per batch, to the blocks of the same forward pass on this thread (under FSDP each
//! block is a module of its own). Ids below the vocabulary are one example: nothing changes.
use std::cell::RefCell;

use tch::{Kind, Tensor};

/// What the blocks of a packed batch need.
#[derive(Debug)]
pub struct Packed {
    /// [B, 1, T, T], true where a position may attend: the same example, not later.
    pub mask: Tensor,
    /// [B, T]: each token's position within its example.
    pub positions: Tensor,
}

thread_local! {
    static CURRENT: RefCell<Option<Packed>> = const { RefCell::new(None) };
}

/// The token ids of `x` and, if it is packed, its mask and positions.
pub fn split(x: &Tensor, vocab: usize) -> (Tensor, Option<Packed>) {
    let v = vocab as i64;
    if x.numel() == 0 || x.max().int64_value(&[]) < v {
        return (x.shallow_clone(), None);
    }
    let (ids, slots) = (x.remainder(v), x.floor_divide_scalar(v));
    let t = x.size()[1];
    let index = Tensor::arange(t, (Kind::Int64, x.device())).unsqueeze(0).expand_as(x);
    // Each token's example starts where its slot first appears (slots never decrease).
    let first = Tensor::ones([x.size()[0], 1], (Kind::Bool, x.device()));
    let starts = Tensor::cat(&[first, slots.narrow(1, 1, t - 1).ne_tensor(&slots.narrow(1, 0, t - 1))], 1);
    let start = (&index * starts.to_kind(Kind::Int64)).cummax(1).0;
    let positions = &index - start;
    let same = slots.unsqueeze(2).eq_tensor(&slots.unsqueeze(1));
    let causal = Tensor::ones([t, t], (Kind::Bool, x.device())).tril(0);
    let mask = same.logical_and(&causal).unsqueeze(1);
    (ids, Some(Packed { mask, positions }))
}

/// Makes `packed` the batch of this thread's forward pass (`None`: not packed).
pub fn set(packed: Option<Packed>) {
    CURRENT.with(|c| *c.borrow_mut() = packed);
}

/// Runs `f` on this thread's packed batch, if any.
pub fn with<R>(f: impl FnOnce(Option<&Packed>) -> R) -> R {
    CURRENT.with(|c| f(c.borrow().as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_example_sees_itself_only_and_counts_from_zero() {
        // Two examples of 2 and 3 tokens (vocab 10), then one padding slot.
        let x = Tensor::from_slice(&[4i64, 5, 16, 17, 18, 20]).view([1, 6]);
        let (ids, packed) = split(&x, 10);
        let p = packed.unwrap();
        assert_eq!(Vec::<i64>::try_from(ids.view([-1])).unwrap(), [4, 5, 6, 7, 8, 0]);
        assert_eq!(Vec::<i64>::try_from(p.positions.view([-1])).unwrap(), [0, 1, 0, 1, 2, 0]);
        let row = |i: i64| Vec::<bool>::try_from(p.mask.get(0).get(0).get(i)).unwrap();
        assert_eq!(row(1), [true, true, false, false, false, false]);
        assert_eq!(row(4), [false, false, true, true, true, false]);
        assert!(split(&Tensor::from_slice(&[1i64, 2]).view([1, 2]), 10).1.is_none());
    }
}
