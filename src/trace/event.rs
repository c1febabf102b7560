//! TensorBoard's event file format: the `Event` protobuf (messages written by hand after
//! tensorboard's `compat/proto/event.proto`, `summary.proto`, `tensor.proto` and the hparams
//! plugin's `plugin_data.proto`, with the same field numbers; only the fields written here) in
//! TFRecord framing: `u64 length, u32 masked CRC-32C of the length, data, u32 masked CRC-32C of
//! the data`, little-endian.
use std::collections::BTreeMap;

use prost::Message;

/// `tensorboard.Event`.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// The first event of a file: "brain.Event:2".
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorboard.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorboard.Summary.Value`: a scalar (`simple_value`) or a tensor with its plugin's metadata.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryValue {
    #[prost(string, tag = "1")]
    pub tag: String,
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorboard.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
    /// `DataClass`: 1 scalar, 2 tensor.
    #[prost(int32, tag = "4")]
    pub data_class: i32,
}

/// `tensorboard.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorboard.TensorProto` (dtype, shape, and the values of a string or float tensor).
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `DataType`: 1 float, 7 string.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorboard.TensorShapeProto`.
#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {
    #[prost(message, repeated, tag = "2")]
    pub dim: Vec<Dim>,
}

/// `tensorboard.TensorShapeProto.Dim`.
#[derive(Clone, PartialEq, Message)]
pub struct Dim {
    #[prost(int64, tag = "1")]
    pub size: i64,
}

/// `tensorboard.hparams.HParamsPluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct HParamsPluginData {
    #[prost(int32, tag = "1")]
    pub version: i32,
    #[prost(message, optional, tag = "3")]
    pub session_start_info: Option<SessionStartInfo>,
    #[prost(message, optional, tag = "4")]
    pub session_end_info: Option<SessionEndInfo>,
}

/// `tensorboard.hparams.SessionStartInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct SessionStartInfo {
    #[prost(btree_map = "string, message", tag = "1")]
    pub hparams: BTreeMap<String, HParamValue>,
    #[prost(string, tag = "4")]
    pub group_name: String,
    #[prost(double, tag = "5")]
    pub start_time_secs: f64,
}

/// `tensorboard.hparams.SessionEndInfo`; `status` 1: success, 2: failure.
#[derive(Clone, PartialEq, Message)]
pub struct SessionEndInfo {
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(double, tag = "2")]
    pub end_time_secs: f64,
}

/// `google.protobuf.Value`: a number, a string or a bool.
#[derive(Clone, PartialEq, Message)]
pub struct HParamValue {
    #[prost(oneof = "Kind", tags = "2, 3, 4")]
    pub kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    #[prost(double, tag = "2")]
    Number(f64),
    #[prost(string, tag = "3")]
    Text(String),
    #[prost(bool, tag = "4")]
    Bool(bool),
}

pub const DT_FLOAT: i32 = 1;
pub const DT_STRING: i32 = 7;
pub const DATA_CLASS_TENSOR: i32 = 2;

/// TFRecord's checksum: CRC-32C, rotated right by 15 bits, plus a constant.
pub fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One record: the event's bytes in TFRecord framing.
pub fn record(event: &Event) -> Vec<u8> {
    let data = event.encode_to_vec();
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(&data);
    out.extend_from_slice(&masked_crc(&data).to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_and_its_mask_match_known_values() {
        // CRC-32C of "123456789" is 0xE3069283 (RFC 3720's check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn a_record_frames_the_encoded_event() {
        let e = Event { wall_time: 1.5, step: 3, file_version: Some("brain.Event:2".into()), summary: None };
        let r = record(&e);
        let len = u64::from_le_bytes(r[..8].try_into().unwrap()) as usize;
        assert_eq!(r.len(), 8 + 4 + len + 4);
        assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), masked_crc(&r[..8]));
        assert_eq!(u32::from_le_bytes(r[12 + len..].try_into().unwrap()), masked_crc(&r[12..12 + len]));
        assert_eq!(Event::decode(&r[12..12 + len]).unwrap(), e);
    }
}
