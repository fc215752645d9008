/*
 * h5compat.h — the one place that tells HDF5 1.10 (Debian 12's) from 1.12 and later.
 *
 * 1.12 gave link iteration a new info struct (H5L_info2_t, for H5Literate2/H5Lvisit2, the default API there) and
 * replaced H5Fis_hdf5 by H5Fis_accessible and H5Oget_info_by_name2 by ...3. Code that iterates links declares
 * its callback with `const amp_h5l_info *`, asks whether a path is an HDF5 file with amp_h5_is_hdf5(path) (> 0:
 * yes, 0: no, < 0: could not tell), and reads an object's basic info (its type) with
 * amp_h5_object_info(loc, name, &info) (an H5O_info_t; < 0 on failure).
 */
#ifndef AMP_H5COMPAT_H
#define AMP_H5COMPAT_H

#include <hdf5.h>

#if H5_VERSION_GE(1, 12, 0)
typedef H5L_info2_t amp_h5l_info;
#define amp_h5_is_hdf5(path) H5Fis_accessible((path), H5P_DEFAULT)
#define amp_h5_object_info(loc, name, info) H5Oget_info_by_name3((loc), (name), (info), H5O_INFO_BASIC, H5P_DEFAULT)
#else
typedef H5L_info_t amp_h5l_info;
#define amp_h5_is_hdf5(path) H5Fis_hdf5(path)
#define amp_h5_object_info(loc, name, info) H5Oget_info_by_name2((loc), (name), (info), H5O_INFO_BASIC, H5P_DEFAULT)
#endif

#endif
