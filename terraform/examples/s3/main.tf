# An S3 checkpoint bucket and an IRSA role for an existing EKS cluster.
#   terraform init && terraform apply -var bucket_name=acme-ml-checkpoints -var cluster_name=gpu
terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}

provider "aws" {
  region = var.region
}

data "aws_eks_cluster" "this" {
  name = var.cluster_name
}

# The cluster's IAM OIDC provider (created with the cluster, e.g. by eksctl or the
# terraform-aws-modules/eks module).
data "aws_iam_openid_connect_provider" "this" {
  url = data.aws_eks_cluster.this.identity[0].oidc[0].issuer
}

module "checkpoints" {
  source = "../../modules/s3-checkpoints"

  bucket_name                   = var.bucket_name
  checkpoint_prefix             = "checkpoints/"
  kms_key_arn                   = var.kms_key_arn
  expire_checkpoints_after_days = var.expire_checkpoints_after_days
  oidc_provider_arn             = data.aws_iam_openid_connect_provider.this.arn
  oidc_provider_url             = data.aws_eks_cluster.this.identity[0].oidc[0].issuer
  namespace                     = "ml-training"
  service_account               = "cloudckpt-trainer"
  role_name                     = "cloudckpt-trainer-${var.cluster_name}"
  tags                          = { "app" = "cloudckpt" }
}
