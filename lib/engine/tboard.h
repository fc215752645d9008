/*
 * tboard.h — TensorBoard event files, written without TensorFlow or a protobuf library.
 *
 * An event file is a sequence of TFRecords: a little-endian uint64 length, the masked CRC-32C of those 8
 * bytes, the data, the masked CRC-32C of the data (CRC-32C is Castagnoli's polynomial; masked is
 * ((crc >> 15) | (crc << 17)) + 0xa282ead8). Each record's data is one tensorflow.Event protobuf, encoded here
 * by hand: wall_time (double), step (int64) and one of file_version, summary or session_log. The file opens
 * with an Event whose file_version is "brain.Event:2", as every TensorBoard writer's does.
 *
 * A scalar is a Summary.Value with tag and simple_value, which is a float: a value reads back as the float
 * nearest the double given. A text is the text plugin's form, as tensorboard's own summary writer makes it:
 * metadata.plugin_data.plugin_name "text" and a scalar DT_STRING TensorProto holding the bytes.
 *
 * Durability: tboard_scalar and tboard_text only append whole records to a buffer in memory; tboard_flush
 * hands each buffered record to the kernel with one write(2). A process killed at any moment (kill -9) leaves
 * every record of the last flush whole in the file. A failed write (disk full, a file-size limit) is cut back
 * to the last whole record and reported by that flush and every later one, naming the file: the file never
 * ends in half a record that this writer made.
 *
 * Memory errors while buffering are kept, like a write error, for the next tboard_flush to report, so the
 * logging calls need no status of their own.
 */
#ifndef AMP_TBOARD_H
#define AMP_TBOARD_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

struct tboard;

#define TBOARD_PREFIX "events.out.tfevents." /* every event file's name starts so (TensorBoard's test) */

/* Create a new event file in `dir` (which must exist):
 * events.out.tfevents.<unix seconds>.<hostname>.<pid>, never an existing file. Its seconds are the time of
 * opening, or one past the newest event file already in `dir` when that is later, so that the directory's
 * files sort by name in the order they were written (TensorBoard reads them in that order). It writes the
 * file_version event, and a SessionLog START event at `first_step`, the first step this writer logs: reading
 * the directory, TensorBoard drops whatever an earlier writer logged at or past that step (the steps of a run
 * killed after its last checkpoint, which a resume trains again). Both are written at once. AMP_ERR_INTERNAL
 * naming the file when it cannot be created. */
enum amp_status tboard_open(struct tboard **w, const char *dir, int64_t first_step, struct amp_error *err);

/* Buffer one scalar (an Event with one Summary.Value) at `step`. */
void tboard_scalar(struct tboard *w, int64_t step, const char *tag, double value);

/* Buffer one text summary at `step` (the text plugin's form; `text` is UTF-8 and shown as Markdown). */
void tboard_text(struct tboard *w, int64_t step, const char *tag, const char *text);

/* Write the buffered records, each with one write(2). AMP_ERR_INTERNAL naming the file on any failure so far. */
enum amp_status tboard_flush(struct tboard *w, struct amp_error *err);

/* Flush, close and free (NULL is allowed). The flush's status. */
enum amp_status tboard_close(struct tboard *w, struct amp_error *err);

/* The event file's path. */
const char *tboard_path(const struct tboard *w);

/* CRC-32C (Castagnoli) of n bytes, and its masked form as TFRecord stores it (exposed for tests). */
uint32_t tboard_crc32c(const void *data, size_t n);
uint32_t tboard_mask_crc(uint32_t crc);

#endif
