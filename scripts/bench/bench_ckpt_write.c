/*
 * bench_ckpt_write.c — one checkpoint file from an optimizer state sharded over the ranks (dist.zero: 1), written
 * two ways, timed: `gather`, each tensor's blocks gathered to rank 0 (MPI_Gatherv) which writes the file alone with
 * HDF5's default driver (what lib/engine/zero.c and checkpoint.c do), against `mpio`, every rank writing its own
 * blocks into the one file collectively with parallel HDF5 (H5Pset_fapl_mpio, H5FD_MPIO_COLLECTIVE transfers).
 * Both then make the file durable as a save does (fsync by rank 0, rename over the final name), and rank 0 reads the
 * file back to check every value, so the two are timed doing the same work.
 *
 * Built and run by scripts/bench/bench_ckpt_write.sh (it needs parallel HDF5: Debian's libhdf5-openmpi-dev, h5pcc):
 *   mpirun -np N bench_ckpt_write MODE FLOATS TENSORS PATH
 * FLOATS values in TENSORS tensors of (nearly) equal size; each tensor is split over the N ranks in blocks of
 * ceil(numel / N) elements in rank order, the last blocks shorter or empty (lib/engine/zero.h's rule). Prints rank
 * 0's seconds from the first rank's start to the file renamed, and the bytes rank 0 held for the gather.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <hdf5.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int rank, world;

static void die(const char *what)
{
    fprintf(stderr, "bench_ckpt_write: rank %d: %s failed\n", rank, what);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static float value_at(int64_t t, int64_t i) { return (float)((i * 7 + t * 13) % 1000) * 0.001f; }

static int64_t tensor_numel(int64_t floats, int64_t tensors, int64_t t)
{
    int64_t n = floats / tensors;
    return t == tensors - 1 ? floats - n * (tensors - 1) : n;
}

/* This rank's block of a tensor of numel elements: [*off, *off + *len). */
static void block_of(int64_t numel, int r, int64_t *off, int64_t *len)
{
    int64_t b = (numel + world - 1) / world;
    int64_t lo = b * r < numel ? b * r : numel, hi = b * (r + 1) < numel ? b * (r + 1) : numel;
    *off = lo;
    *len = hi - lo;
}

static void fill_block(float *buf, int64_t t, int64_t off, int64_t len)
{
    for (int64_t i = 0; i < len; i++)
        buf[i] = value_at(t, off + i);
}

static hid_t make_dataset(hid_t file, int64_t t, int64_t numel)
{
    char name[32];
    snprintf(name, sizeof name, "t%05lld", (long long)t);
    hsize_t dim = (hsize_t)numel;
    hid_t space = H5Screate_simple(1, &dim, NULL);
    hid_t ds = H5Dcreate2(file, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Sclose(space);
    if (ds < 0)
        die("H5Dcreate2");
    return ds;
}

/* Rank 0 gathers each tensor and writes it; the others send their blocks. Returns rank 0's gather buffer bytes. */
static size_t write_gather(const char *tmp, int64_t floats, int64_t tensors, float *mine)
{
    int64_t most = tensor_numel(floats, tensors, tensors - 1);
    float *whole = rank == 0 ? malloc((size_t)most * sizeof *whole) : NULL;
    int *counts = malloc((size_t)world * sizeof *counts), *displs = malloc((size_t)world * sizeof *displs);
    if ((rank == 0 && !whole) || !counts || !displs)
        die("malloc");
    hid_t file = rank == 0 ? H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT) : -1;
    if (rank == 0 && file < 0)
        die("H5Fcreate");
    for (int64_t t = 0; t < tensors; t++) {
        int64_t numel = tensor_numel(floats, tensors, t), off, len;
        for (int r = 0; r < world; r++) {
            block_of(numel, r, &off, &len);
            counts[r] = (int)len;
            displs[r] = (int)off;
        }
        block_of(numel, rank, &off, &len);
        fill_block(mine, t, off, len);
        MPI_Gatherv(mine, (int)len, MPI_FLOAT, whole, counts, displs, MPI_FLOAT, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            hid_t ds = make_dataset(file, t, numel);
            if (H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, whole) < 0)
                die("H5Dwrite");
            H5Dclose(ds);
        }
    }
    if (rank == 0 && H5Fclose(file) < 0)
        die("H5Fclose");
    free(whole);
    free(counts);
    free(displs);
    return rank == 0 ? (size_t)most * sizeof(float) : 0;
}

/* Every rank writes its blocks into the one file, collectively. */
static void write_mpio(const char *tmp, int64_t floats, int64_t tensors, float *mine)
{
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS), dxpl = H5Pcreate(H5P_DATASET_XFER);
    if (H5Pset_fapl_mpio(fapl, MPI_COMM_WORLD, MPI_INFO_NULL) < 0 || H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_COLLECTIVE) < 0)
        die("H5Pset_fapl_mpio / H5Pset_dxpl_mpio");
    hid_t file = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
    if (file < 0)
        die("H5Fcreate (mpio)");
    for (int64_t t = 0; t < tensors; t++) {
        int64_t numel = tensor_numel(floats, tensors, t), off, len;
        block_of(numel, rank, &off, &len);
        fill_block(mine, t, off, len);
        hid_t ds = make_dataset(file, t, numel);
        hid_t fspace = H5Dget_space(ds);
        hsize_t start = (hsize_t)off, count = (hsize_t)len;
        hid_t mspace = H5Screate_simple(1, &count, NULL);
        if (len > 0)
            H5Sselect_hyperslab(fspace, H5S_SELECT_SET, &start, NULL, &count, NULL);
        else {
            H5Sselect_none(fspace);
            H5Sselect_none(mspace);
        }
        if (H5Dwrite(ds, H5T_NATIVE_FLOAT, mspace, fspace, dxpl, mine) < 0)
            die("H5Dwrite (collective)");
        H5Sclose(mspace);
        H5Sclose(fspace);
        H5Dclose(ds);
    }
    if (H5Fclose(file) < 0)
        die("H5Fclose (mpio)");
    H5Pclose(fapl);
    H5Pclose(dxpl);
}

/* Rank 0: the file durable under its final name, as a save makes it (fsync, rename, fsync of the directory). */
static void make_durable(const char *tmp, const char *path)
{
    int fd = open(tmp, O_RDONLY);
    if (fd < 0 || fsync(fd) != 0)
        die("fsync");
    close(fd);
    if (rename(tmp, path) != 0)
        die("rename");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    int dfd = open(slash ? dir : ".", O_RDONLY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
}

/* Rank 0: every value of the file is the one written. */
static void check_file(const char *path, int64_t floats, int64_t tensors)
{
    int64_t most = tensor_numel(floats, tensors, tensors - 1);
    float *buf = malloc((size_t)most * sizeof *buf);
    hid_t file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (!buf || file < 0)
        die("reading the file back");
    for (int64_t t = 0; t < tensors; t++) {
        char name[32];
        snprintf(name, sizeof name, "t%05lld", (long long)t);
        hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
        int64_t numel = tensor_numel(floats, tensors, t);
        if (ds < 0 || H5Sget_simple_extent_npoints(H5Dget_space(ds)) != numel ||
            H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) < 0)
            die("reading a tensor back");
        for (int64_t i = 0; i < numel; i++)
            if (buf[i] != value_at(t, i)) {
                fprintf(stderr, "bench_ckpt_write: %s: tensor %lld element %lld is %g, written %g\n", path,
                        (long long)t, (long long)i, (double)buf[i], (double)value_at(t, i));
                MPI_Abort(MPI_COMM_WORLD, 1);
            }
        H5Dclose(ds);
    }
    H5Fclose(file);
    free(buf);
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc != 5 || (strcmp(argv[1], "gather") != 0 && strcmp(argv[1], "mpio") != 0)) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np N bench_ckpt_write gather|mpio FLOATS TENSORS PATH\n");
        MPI_Finalize();
        return 2;
    }
    int64_t floats = atoll(argv[2]), tensors = atoll(argv[3]);
    const char *path = argv[4];
    if (floats < 1 || tensors < 1 || tensors > floats)
        die("arguments (FLOATS >= TENSORS >= 1)");
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int64_t most = tensor_numel(floats, tensors, tensors - 1);
    float *mine = malloc((size_t)((most + world - 1) / world) * sizeof *mine + sizeof(float));
    if (!mine)
        die("malloc");
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    size_t held = 0;
    if (strcmp(argv[1], "gather") == 0)
        held = write_gather(tmp, floats, tensors, mine);
    else
        write_mpio(tmp, floats, tensors, mine);
    if (rank == 0)
        make_durable(tmp, path);
    MPI_Barrier(MPI_COMM_WORLD);
    double secs = MPI_Wtime() - t0;
    if (rank == 0) {
        check_file(path, floats, tensors);
        printf("%s np=%d floats=%lld tensors=%lld seconds=%.3f MB/s=%.0f rank0_gather_bytes=%zu\n", argv[1], world,
               (long long)floats, (long long)tensors, secs, (double)floats * 4 / 1e6 / secs, held);
    }
    free(mine);
    MPI_Finalize();
    return 0;
}
